"""MoE-SpeQ's draft lookahead beside on-demand offloading, at 1 to 64 sequences.

    python benchmarks/lookahead.py [--batches 1 8 32 64] [--budgets 0.5 0.25]
                                   [--max-tokens 32] [--eager]

Four engines side by side in this process: vanilla vLLM; the plugin (``fetch``, LRU);
the plugin with the path predictor (``cache: plec``, its step demand); the plugin with
``lookahead: {}`` (an INT4 draft through vLLM's speculative decoding, k_max 4). Budget,
cache and the draft length switch with ``reconfigure``. Modes: vanilla, ``fetch`` + LRU,
``fetch`` + PLEC, lookahead with a fixed k = 1, 2, 4 and with the governor (LRU), and the
governor with ``cache: plec`` (the draft's routes as its lookahead). Every lookahead
mode gets one short unmeasured run after its reconfigure (the governor measures each k
once before choosing).

Every run is ``LLM.generate`` of ``batch`` held-out prompts at once, greedy,
``--max-tokens`` each, on the emulated link (MODELED: one expert copy takes
``--copy-compute-ratio`` times one MoE layer's batch-1 decode compute of vanilla, see
``common.py``); the draft's compute (its INT4 experts decoded on this CPU) is real time.
Reports output tok/s (prefill included), MB moved per output token after the first
(decode bytes / decode-produced tokens: the verification passes' loads are divided by
the tokens they accepted), the draft's acceptance, the draft lengths chosen, p50/p99
TPOT per request, and whether the tokens equal vanilla's. Writes
``benchmarks/results/lookahead.json`` and ``lookahead.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from batched import plot, run
from common import (
    RESULTS,
    add_engine_arguments,
    command_line,
    held_out_prompts,
    link_like_a_gpu_box,
    model_of,
    modeled,
    modeled_label,
    write_result,
)

from vllm_specexpert.tools.embedded_model import ASSETS
from vllm_specexpert.tools.harness import start_engine, stop_engine

K_MAX = 4


def figures(llm, batch: int, result: dict) -> dict:
    """Per output token and lookahead figures of the last run."""
    import vllm_specexpert

    stats = vllm_specexpert.get_stats(llm)[0]
    decode = stats["total"]["decode"]
    produced = max(sum(len(t) for t in result["tokens"]) - batch, 1)  # after the first
    row = {
        "mb_per_token": decode["bytes_loaded"] / produced / 1e6,
        "stall_ms_per_token": decode["stall_s"] / produced * 1e3,
        "hit_rate": decode["hit_rate"],
    }
    lookahead = stats.get("lookahead")
    if lookahead:
        row.update(
            acceptance=lookahead["acceptance"],
            steps_by_k=lookahead["steps_by_k"],
            demand_coverage=decode["path_covered"] / max(decode["path_needed"], 1),
            draft_loads=lookahead.get("draft", {}).get("loads"),
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(parser, "lookahead")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    import vllm_specexpert

    model = model_of(args)
    seqs = max(args.batches)
    prompts = held_out_prompts(seqs)
    common = {"eager": args.eager, "max_num_seqs": seqs, "disable_log_stats": False}
    vanilla = start_engine(model, None, **common)
    plugin = start_engine(model, {"budget": 0.5}, **common)
    path_predictor = str(ASSETS / "tiny-qwen3-moe-path-predictor")
    predicted = start_engine(model, {"budget": 0.5, "path_predictor": path_predictor}, **common)
    drafted = start_engine(model, {"budget": 0.5, "lookahead": {"k_max": K_MAX}}, **common)
    link, _, _ = link_like_a_gpu_box(vanilla, plugin, args)
    modes = [
        ("fetch + LRU", plugin, {"cache": "lru"}),
        ("fetch + PLEC", predicted, {"cache": "plec"}),
    ]
    modes += [
        (f"lookahead k={k}", drafted, {"cache": "lru", "lookahead": {"k_max": K_MAX, "k": k}})
        for k in (1, 2, 4)
    ]
    modes += [
        ("lookahead governor", drafted, {"cache": "lru", "lookahead": {"k_max": K_MAX}}),
        ("lookahead governor + PLEC", drafted, {"cache": "plec", "lookahead": {"k_max": K_MAX}}),
    ]
    rows = []
    for batch in args.batches:
        batch_prompts = prompts[:batch]
        run(vanilla, batch_prompts, 4)  # warm up this batch size
        reference = run(vanilla, batch_prompts, args.max_tokens)
        rows.append(
            {
                "mode": "vanilla",
                "batch": batch,
                "budget": None,
                **{k: v for k, v in reference.items() if k != "tokens"},
            }
        )
        print(rows[-1], flush=True)
        for budget in args.budgets:
            for name, llm, settings in modes:
                vllm_specexpert.reconfigure(llm, budget=budget, link=link, **settings)
                if "lookahead" in settings:
                    run(llm, batch_prompts, 48)  # the governor measures each k twice
                vllm_specexpert.reset_stats(llm)
                result = run(llm, batch_prompts, args.max_tokens)
                row = {
                    "mode": name,
                    "batch": batch,
                    "budget": budget,
                    **{k: v for k, v in result.items() if k != "tokens"},
                    **figures(llm, batch, result),
                    "speed_vs_vanilla": result["tok_s"] / reference["tok_s"],
                    "identical_to_vanilla": result["tokens"] == reference["tokens"],
                }
                rows.append(row)
                print(
                    {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
                    flush=True,
                )
    for llm in (vanilla, plugin, predicted, drafted):
        stop_engine(llm)
    for row in rows:  # ratios against fetch + LRU of the same batch and budget
        lru = next(
            (
                r
                for r in rows
                if r["mode"] == "fetch + LRU"
                and r["batch"] == row["batch"]
                and r["budget"] == row["budget"]
            ),
            None,
        )
        if lru is not None:
            row["tok_s_vs_lru"] = row["tok_s"] / lru["tok_s"]
            row["mb_vs_lru"] = row["mb_per_token"] / max(lru["mb_per_token"], 1e-12)
    result = {
        "command": command_line(),
        "model": model,
        "batches": args.batches,
        "budgets": args.budgets,
        "max_tokens": args.max_tokens,
        "k_max": K_MAX,
        "modeled": modeled(link, args.copy_compute_ratio),
        "rows": rows,
    }
    path = write_result(args.name, result)
    plot(
        result,
        RESULTS / f"{args.name}.png",
        f"{Path(model).name}, {args.max_tokens} tokens per sequence, "
        f"{modeled_label(link, args.copy_compute_ratio)}\n{command_line()}",
        per_token="MB moved per output token",
    )
    print(f"wrote {path} and {args.name}.png\ncommand: {command_line()}")


if __name__ == "__main__":
    main()
