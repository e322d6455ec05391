"""Batched decode: many concurrent sequences, offloaded experts, with and without the
token scheduler (ExpertFlow §3.3) and the predictive cache (``plec``, §3.4).

    python benchmarks/batched.py [--batches 8 16 32 64] [--budgets 0.25 0.5]
                                 [--policies fetch cpu auto] [--plec-preload none]
                                 [--max-tokens 16]
                                 [--group-size 16] [--max-wait-steps 4]

Four engines side by side in this process: vanilla vLLM; the plugin; the plugin with
the path predictor (its scheduler predicts each step's demand, which ``plec`` uses); and
the plugin with the token scheduler too (both replace vLLM's scheduler class, so they
cannot be switched on by ``reconfigure``). The plugins switch budget, cache and miss
policy with ``reconfigure``. Every run is ``LLM.generate`` of ``batch`` held-out prompts at once,
greedy, ``--max-tokens`` each, on the emulated link (MODELED: one expert copy takes
``--copy-compute-ratio`` times one MoE layer's batch-1 decode compute of vanilla, the host
computes experts ``host_slowdown`` times slower than this CPU; see ``common.py``).

Modes: vanilla; ``fetch`` (on-demand, LRU), ``cpu`` and ``auto``, each alone, "+ PLEC"
(``cache: plec`` at the same total budget), "+ token scheduler" and "+ both"; and
``fetch`` with LFU, for the cache comparison.

Reports per run: output tok/s (prefill included, as ``vllm bench throughput``), decode
steps, distinct (layer, expert) pairs requested per decode step, MB moved per decode
token, decode hit rate (per request, and per distinct pair a call needs), and p50/p99
of the per-request TPOT (vLLM's request timestamps). For the cache question it also
reports the pairs a step needs and a floor on the loads any cache policy needs to serve
them, ``max(0, needed - total slots)`` per step: how much a predictive cache
(ExpertFlow's PLEC) could save at most against LRU.
Writes ``benchmarks/results/batched.json`` and ``batched.png``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

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

POLICIES = ("fetch", "cpu", "auto")


def run(llm, prompts: list[str], max_tokens: int) -> dict:
    """One batched generate: throughput and per-request TPOT."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tpots = sorted(
        (o.metrics.last_token_ts - o.metrics.first_token_ts) / (max_tokens - 1)
        for o in outputs
        if o.metrics is not None and max_tokens > 1
    )
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "tok_s": tokens / elapsed,
        "seconds": elapsed,
        "tpot_p50_ms": statistics.median(tpots) * 1e3 if tpots else None,
        "tpot_p99_ms": tpots[min(len(tpots) - 1, int(0.99 * len(tpots)))] * 1e3 if tpots else None,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
    }


def cache_figures(llm) -> dict:
    """Decode counters of the last run, per decode token and per decode step."""
    import vllm_specexpert

    stats = vllm_specexpert.get_stats(llm)[0]
    total = stats["total"]["decode"]
    first = next(iter(stats["layers"].values()))["decode"]
    tokens = max(stats["decode_tokens"], 1)
    steps = max(first["calls"], 1)
    slots = sum(stats["slots_per_layer"].values())
    expert_mb = next(iter(stats["expert_bytes"].values())) / 1e6
    needed = total["experts_needed"] / steps
    # No cache policy that runs the router's experts can load fewer than this per step
    # on average: a step needs `needed` (layer, expert) pairs, at most `slots` of them
    # can be resident from before, and max(0, x - S) is convex (Jensen).
    floor = max(0.0, needed - slots)
    return {
        "decode_steps": first["calls"],
        "pairs_per_step": total["requests"] / steps,
        "needed_per_step": needed,
        "loads_per_step": total["loads"] / steps,
        "min_loads_per_step": floor,
        "mb_per_token": total["bytes_loaded"] / tokens / 1e6,
        "min_mb_per_token": floor * expert_mb * steps / tokens,
        "hit_rate": total["hit_rate"],
        # Per distinct (layer, expert) a call needs; hit_rate counts a request again each
        # time a call that does not fit runs another token group.
        "needed_hit_rate": 1 - total["misses"] / max(total["experts_needed"], 1),
        "host_entries_per_token": total.get("host_entries", 0) / tokens,
    }


def plot(
    result: dict, path: Path, title: str, per_token: str = "MB moved per decode token"
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = result["budgets"]
    fig, axes = plt.subplots(2, len(budgets), figsize=(6 * len(budgets), 8), squeeze=False)
    for col, budget in enumerate(budgets):
        rows = [r for r in result["rows"] if r["budget"] in (budget, None)]
        for mode in dict.fromkeys(r["mode"] for r in rows):
            mine = [r for r in rows if r["mode"] == mode]
            axes[0][col].plot(
                [r["batch"] for r in mine], [r["tok_s"] for r in mine], marker="o", label=mode
            )
            if mode != "vanilla" and any(r["mb_per_token"] for r in mine):
                axes[1][col].plot(
                    [r["batch"] for r in mine],
                    [r["mb_per_token"] for r in mine],
                    marker="o",
                    label=mode,
                )
            if mode == "fetch":
                axes[1][col].plot(
                    [r["batch"] for r in mine],
                    [r["min_mb_per_token"] for r in mine],
                    linestyle="--",
                    color="black",
                    label="floor of any cache policy (fetch)",
                )
        axes[0][col].set(
            title=f"budget {budget}: output tok/s [modeled link]",
            xlabel="concurrent sequences",
            xscale="log",
            yscale="log",
        )
        axes[1][col].set(
            title=f"budget {budget}: {per_token}", xlabel="concurrent sequences", xscale="log"
        )
        for ax in (axes[0][col], axes[1][col]):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(parser, "batched")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--plec-preload", default="none", choices=("none", "step", "next"))
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--max-wait-steps", type=int, default=4)
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
    grouped = start_engine(
        model,
        {
            "budget": 0.5,
            "path_predictor": path_predictor,
            "token_scheduler": {
                "group_size": args.group_size,
                "max_wait_steps": args.max_wait_steps,
            },
        },
        **common,
    )
    link, _, _ = link_like_a_gpu_box(vanilla, plugin, args)
    modes = (
        ("", plugin, "lru"),
        (" + LFU", plugin, "lfu"),
        (" + PLEC", predicted, "plec"),
        (" + token scheduler", grouped, "lru"),
        (" + both", grouped, "plec"),
    )
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
            for policy in args.policies:
                for name, llm, cache in modes:
                    if cache == "lfu" and policy != "fetch":
                        continue  # the cache comparison is made under fetch
                    preload = {"plec_preload": args.plec_preload} if cache == "plec" else {}
                    vllm_specexpert.reconfigure(
                        llm, budget=budget, miss_policy=policy, cache=cache, link=link, **preload
                    )
                    vllm_specexpert.reset_stats(llm)
                    result = run(llm, batch_prompts, args.max_tokens)
                    row = {
                        "mode": f"{policy}{name}",
                        "batch": batch,
                        "budget": budget,
                        **{k: v for k, v in result.items() if k != "tokens"},
                        **cache_figures(llm),
                        "speed_vs_vanilla": result["tok_s"] / reference["tok_s"],
                    }
                    if policy == "fetch":  # exact: the same tokens as vanilla
                        row["identical_to_vanilla"] = result["tokens"] == reference["tokens"]
                    rows.append(row)
                    print(
                        {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
                        flush=True,
                    )
    for llm in (vanilla, plugin, predicted, grouped):
        stop_engine(llm)
    result = {
        "command": command_line(),
        "model": model,
        "batches": args.batches,
        "budgets": args.budgets,
        "max_tokens": args.max_tokens,
        "plec_preload": args.plec_preload,
        "token_scheduler": {"group_size": args.group_size, "max_wait_steps": args.max_wait_steps},
        "modeled": modeled(link, args.copy_compute_ratio),
        "rows": rows,
    }
    path = write_result(args.name, result)
    plot(
        result,
        RESULTS / f"{args.name}.png",
        f"{Path(model).name}, {args.max_tokens} tokens per sequence, "
        f"{modeled_label(link, args.copy_compute_ratio)}\n{command_line()}",
    )
    print(f"wrote {path} and {args.name}.png\ncommand: {command_line()}")


if __name__ == "__main__":
    main()
