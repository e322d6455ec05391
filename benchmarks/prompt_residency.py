"""What a prompt leaves resident for one sequence's decode: the embedded model's routes
(a held-out prompt's pass, then its greedy decode) replayed through the plugin's own
engine with the experts in a pack on disk, its slots per layer only (an engine for one
sequence) against the same memory split into own slots and the shared region (an engine
for ``--max-num-seqs``, where a call may need every expert; issue 74).

    python benchmarks/prompt_residency.py [--prompts 6] [--tokens 32]
                                          [--budgets 25 16] [--max-num-seqs 128]

The prompt runs as one prefill call a layer (every prompt token), then each decode step
as a call of one token a layer. Loads are counted by the engine (tiny random weights:
no timing, no I/O time); ``decode_loads`` per decode step, summed over the prompts, each
from a fresh engine (the warm start). Writes ``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cache_bound import replay_engine
from common import held_out_prompts, write_result

from specexpert_testbed.fixtures import DEFAULT_MODEL, model_path
from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.phases import PassPhases
from vllm_specexpert.tools import trace


def decode_loads(
    routes: list[tuple[np.ndarray, np.ndarray]], budget: int, max_num_seqs: int, cache: str
) -> dict:
    """Each prompt in a fresh engine of ``budget`` slots a layer sized for
    ``max_num_seqs`` sequences: its loads per decode step, summed over the prompts."""
    _, layers, top_k = routes[0][0].shape
    experts = 64
    config = SpecExpertConfig.from_dict({"budget": budget, "cache": cache, "quality": None})

    def kernel(x, topk_weights, ids, slots, expert_map=None, **_):
        return torch.zeros_like(x)

    def run(engine, name: str, ids: np.ndarray, phases: PassPhases) -> None:
        ids_t = torch.from_numpy(ids).to(torch.int32)
        x = torch.zeros(ids.shape[0], 16, dtype=torch.bfloat16)
        weights = torch.full(ids_t.shape, 1 / top_k)
        engine.run_call(LayerCall(name, kernel, x, weights, ids_t, phases))

    per_step = np.zeros(routes[0][1].shape[0], dtype=np.int64)
    split = None
    for prefill, steps in routes:
        with replay_engine(config, layers, experts, top_k, max_num_seqs) as (engine, names):
            for layer, name in enumerate(names):
                run(engine, name, prefill[:, layer], PassPhases.prefill_only(prefill.shape[0]))
            before = 0
            for step in range(steps.shape[0]):
                for layer, name in enumerate(names):
                    run(engine, name, steps[step, layer][None], PassPhases.decode_only(1))
                loads = engine.stats()["total"]["decode"]["loads"]
                per_step[step] += loads - before
                before = loads
            stats = engine.stats()
            split = (
                next(iter(stats["slots_per_layer"].values())),
                next(iter(stats["region_rows_per_layer"].values())),
            )
            engine.close()
    assert split is not None
    return {
        "budget": budget,
        "max_num_seqs": max_num_seqs,
        "cache": cache,
        "own_slots": split[0],
        "region_rows": split[1],
        "decode_loads_per_step": per_step.tolist(),
        "decode_loads_15_steps": int(per_step[:15].sum()),
        "decode_loads": int(per_step.sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--budgets", type=int, nargs="+", default=[25, 16])
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--cache", default="lrfu")
    parser.add_argument("--name", default="prompt_residency")
    args = parser.parse_args()
    prompts = held_out_prompts(args.prompts, 32)
    routes = trace.record_prompt_routes(model_path(DEFAULT_MODEL), prompts, args.tokens)
    rows = []
    for budget in args.budgets:
        alone = decode_loads(routes, budget, 1, args.cache)
        shared = decode_loads(routes, budget, args.max_num_seqs, args.cache)
        for row in (alone, shared):
            rows.append(row)
            print(
                f"budget {budget}, max_num_seqs {row['max_num_seqs']:3d}: "
                f"{row['own_slots']} own + {row['region_rows']} rows, decode loads "
                f"{row['decode_loads_15_steps']} in 15 steps, {row['decode_loads']} in "
                f"{args.tokens - 1} (x{row['decode_loads'] / alone['decode_loads']:.3f})",
                flush=True,
            )
    path = write_result(args.name, {"prompts": args.prompts, "tokens": args.tokens, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
