"""What holding decode sequences back costs vLLM, apart from the experts.

    python benchmarks/unschedule_cost.py [--sequences 32] [--group-size 16] [--max-tokens 32]
                                         [--rounds 3]

The token scheduler runs ``group_size`` of the runnable decode sequences per step and
holds the others back; a held-back request leaves the model runner's persistent batch
and is added back when it runs again. This measures that cost at budget 1.0 (every
expert resident: no loads, so only scheduling and the runner's batch changes differ):

* ``grouped``: ``--sequences`` requests at once with the token scheduler, which then
  runs decode steps of about ``group_size`` sequences;
* ``plain``: the same requests in chunks of ``group_size`` after one another, so every
  decode step also has ``group_size`` sequences, none held back.

Both do the same decode steps of the same size; the difference per decode step is the
cost of holding back and re-adding requests plus the scheduler's own CPU time (reported
apart, from its counters). Medians over ``--rounds`` interleaved rounds. Writes
``benchmarks/results/unschedule_cost.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, held_out_prompts, model_of, write_result

from vllm_specexpert.tools.embedded_model import ASSETS
from vllm_specexpert.tools.harness import start_engine, stop_engine


def generate_seconds(llm, prompts: list[str], max_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--name", default="unschedule_cost")
    args = parser.parse_args()

    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read the scheduler's counters
    model = model_of(args)
    prompts = held_out_prompts(args.sequences)
    common = {"eager": args.eager, "max_num_seqs": args.sequences}
    plain = start_engine(model, {"budget": 1.0}, **common)
    grouped = start_engine(
        model,
        {
            "budget": 1.0,
            "path_predictor": str(ASSETS / "tiny-qwen3-moe-path-predictor"),
            "token_scheduler": {"group_size": args.group_size, "max_wait_steps": 1000},
        },
        **common,
    )
    scheduler = grouped.llm_engine.engine_core.engine_core.scheduler
    chunks = [prompts[i : i + args.group_size] for i in range(0, len(prompts), args.group_size)]
    generate_seconds(plain, prompts[:4], 4)
    generate_seconds(grouped, prompts[:4], 4)
    samples = {"grouped": [], "plain": [], "steps": [], "scheduler_cpu_s": []}
    for _ in range(args.rounds):
        before = asdict(scheduler.stats)
        samples["grouped"].append(generate_seconds(grouped, prompts, args.max_tokens))
        after = asdict(scheduler.stats)
        samples["steps"].append(after["grouped_steps"] - before["grouped_steps"])
        samples["scheduler_cpu_s"].append(after["cpu_s"] - before["cpu_s"])
        samples["plain"].append(
            sum(generate_seconds(plain, chunk, args.max_tokens) for chunk in chunks)
        )
    stop_engine(plain)
    stop_engine(grouped)
    grouped_s = statistics.median(samples["grouped"])
    plain_s = statistics.median(samples["plain"])
    steps = statistics.median(samples["steps"])
    cpu_s = statistics.median(samples["scheduler_cpu_s"])
    result = {
        "command": command_line(),
        "model": model,
        "sequences": args.sequences,
        "group_size": args.group_size,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "samples": samples,
        "grouped_s": grouped_s,
        "plain_s": plain_s,
        "grouped_steps": steps,
        "extra_ms_per_grouped_step": (grouped_s - plain_s) / max(steps, 1) * 1e3,
        "scheduler_cpu_ms_per_grouped_step": cpu_s / max(steps, 1) * 1e3,
    }
    path = write_result(args.name, result)
    print({k: v for k, v in result.items() if k != "samples"})
    print(f"wrote {path}\ncommand: {command_line()}")


if __name__ == "__main__":
    main()
