"""Decode TPOT with next-layer prefetch vs on-demand loading (speculating-experts §5).

    python benchmarks/prefetch.py [--model DIR] [--calibration DIR] [--budgets 0.25 0.5]
                                  [--batches 1 8] [--rounds 3] [--copy-compute-ratio 2.7]

Per batch size and budget, in interleaved rounds on one plugin engine (modes switch with
``reconfigure``) beside one vanilla engine: on-demand loading (``predictor: none``),
prefetch + ``fetch`` (exact) and prefetch + ``speculate`` with the ``router`` and
``quasi_hidden`` predictors. The emulated link makes one expert copy take
``--copy-compute-ratio`` times one MoE layer's batch-1 decode compute (measured on
vanilla), so that on-demand loading spends most of its time copying, as on a GPU box.

Besides TPOT, it reports the analytic bound of the paper, ΔT = Σ_l min(t_copy,l,
t_compute,l), with t_copy,l the on-demand stall of layer l per decode step and
t_compute,l the rest of the on-demand step split evenly over the layers, and the share
of it each prefetch mode achieves. Writes ``benchmarks/results/prefetch.json`` and
``prefetch.png``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
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
    step_seconds,
    timed_generate,
    write_result,
)

from vllm_specexpert.tools.harness import start_engine, stop_engine

MODES = {
    "on-demand": {"predictor": "none", "miss_policy": "fetch"},
    "prefetch router": {"predictor": "router", "miss_policy": "fetch"},
    "prefetch quasi_hidden": {"predictor": "quasi_hidden", "miss_policy": "fetch"},
    "prefetch quasi_hidden, all": {
        "predictor": "quasi_hidden",
        "miss_policy": "fetch",
        "prefetch_filter": "all",
    },
    "speculate router": {"predictor": "router", "miss_policy": "speculate"},
    "speculate quasi_hidden": {"predictor": "quasi_hidden", "miss_policy": "speculate"},
}
"""Prefetch modes filter predicted experts by cost (the default) unless marked ``all``."""


def config_of(budget: float, link: dict, mode: dict) -> dict:
    return {"budget": budget, "link": link, "prefetch_filter": "cost", **mode}


def decode_stats(llm, prompts, max_tokens: int) -> list[dict]:
    """Per-layer decode counters per decode step of one ``max_tokens`` run: the engine
    counts decode tokens apart from the prompts' prefill."""
    import vllm_specexpert

    vllm_specexpert.reset_stats(llm)
    timed_generate(llm, prompts, max_tokens)
    stats = vllm_specexpert.get_stats(llm)[0]
    steps = stats["decode_tokens"] / len(prompts)
    return [
        {
            key: layer["decode"].get(key, 0) / steps  # (prediction's: while a predictor runs)
            for key in (
                "stall_s",
                "misses",
                "prefetched",
                "prefetch_used",
                "prefetch_skipped",
                "bytes_loaded",
                "predicted",
                "predicted_correct",
            )
        }
        for layer in stats["layers"].values()
    ]


def plot(cases: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 4.5), squeeze=False)
    for ax, case in zip(axes[0], cases, strict=True):
        names = [r["mode"] for r in case["rows"]]
        values = [r["tpot_ms"] for r in case["rows"]]
        bars = ax.bar(
            range(len(names)), values, color=["#555", "#c44"] + ["#3b7dd8"] * 3 + ["#e39b2d"] * 2
        )
        for bar, row in zip(bars, case["rows"], strict=True):
            ax.annotate(
                f"{row['tpot_ms']:.1f}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
        floor = case["on_demand_tpot_ms"] - case["bound_ms"]
        ax.axhline(floor, color="green", linestyle="--", linewidth=1, label="on-demand − ΔT bound")
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=7)
        ax.set_title(f"batch {case['batch']}, budget {case['budget']}", fontsize=9)
        ax.set_ylabel("TPOT ms")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(parser, "prefetch")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    from common import default_calibration

    import vllm_specexpert

    model = model_of(args)
    calibration = args.calibration or default_calibration(model)
    vanilla = start_engine(model, None, eager=args.eager)
    plugin = start_engine(
        model,
        {"budget": args.budgets[0], "predictor": "quasi_hidden", "calibration": calibration},
        eager=args.eager,
    )
    prompts = held_out_prompts(max(args.batches))
    link, vanilla_step, expert_bytes = link_like_a_gpu_box(vanilla, plugin, args)

    cases = []
    for batch in args.batches:
        batch_prompts = prompts[:batch]
        for budget in args.budgets:
            samples: dict[str, list[float]] = {"vanilla": []}
            for round_index in range(args.rounds):
                timed_generate(vanilla, batch_prompts, 4)
                samples["vanilla"].append(
                    step_seconds(vanilla, batch_prompts, args.max_tokens, args.repeats)[0]
                )
                for name, mode in MODES.items():
                    vllm_specexpert.reconfigure(plugin, **config_of(budget, link, mode))
                    timed_generate(plugin, batch_prompts, 4)  # warm the rebuilt cache
                    samples.setdefault(name, []).append(
                        step_seconds(plugin, batch_prompts, args.max_tokens, args.repeats)[0]
                    )
                print(
                    f"batch {batch} budget {budget} round {round_index + 1}: "
                    + ", ".join(f"{n} {statistics.median(v) * 1e3:.2f}" for n, v in samples.items())
                )
            per_layer = {}
            for name, mode in MODES.items():
                vllm_specexpert.reconfigure(plugin, **config_of(budget, link, mode))
                timed_generate(plugin, batch_prompts, 4)
                per_layer[name] = decode_stats(plugin, batch_prompts, args.max_tokens)
            cases.append(summarize(batch, budget, samples, per_layer))
    stop_engine(plugin)
    stop_engine(vanilla)

    payload = {
        "model": model,
        "calibration": calibration,
        "eager": args.eager,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "modeled": modeled(
            link,
            args.copy_compute_ratio,
            expert_bytes=expert_bytes,
            vanilla_batch1_step_ms=vanilla_step * 1e3,
        ),
        "cases": cases,
    }
    path = write_result(args.name, payload)
    plot(
        cases,
        RESULTS / f"{args.name}.png",
        f"{Path(model).name}; {'eager' if args.eager else 'compiled'}; decode TPOT, "
        f"{modeled_label(link, args.copy_compute_ratio)}\n{command_line()}",
    )
    print_table(cases)
    print(f"wrote {path} and {path.with_suffix('.png')}\ncommand: {command_line()}")


def summarize(batch: int, budget: float, samples: dict, per_layer: dict) -> dict:
    tpot = {name: statistics.median(v) for name, v in samples.items()}
    on_demand = tpot["on-demand"]
    stall = [layer["stall_s"] for layer in per_layer["on-demand"]]
    compute = max(on_demand - sum(stall), 0.0) / len(stall)
    bound = sum(min(s, compute) for s in stall)
    rows = []
    for name, value in tpot.items():
        row = {
            "mode": name,
            "tpot_ms": value * 1e3,
            "tok_s": batch / value,
            "speed_vs_vanilla": tpot["vanilla"] / value,
            "samples_ms": [v * 1e3 for v in samples[name]],
        }
        if name in per_layer:
            layers = per_layer[name]
            total = {key: sum(layer[key] for layer in layers) for key in layers[0]}
            predicted = total["predicted"]
            row.update(
                stall_ms_per_step=total["stall_s"] * 1e3,
                misses_per_step=total["misses"],
                prefetched_per_step=total["prefetched"],
                prefetch_used_per_step=total["prefetch_used"],
                prefetch_skipped_per_step=total["prefetch_skipped"],
                mb_per_step=total["bytes_loaded"] / 1e6,
                recall=(total["predicted_correct"] / predicted) if predicted else None,
                saved_ms=(on_demand - value) * 1e3,
                share_of_bound=((on_demand - value) / bound) if bound > 0 else None,
            )
        rows.append(row)
    return {
        "batch": batch,
        "budget": budget,
        "on_demand_tpot_ms": on_demand * 1e3,
        "on_demand_stall_ms_per_layer": [s * 1e3 for s in stall],
        "compute_ms_per_layer": compute * 1e3,
        "bound_ms": bound * 1e3,
        "rows": rows,
    }


def print_table(cases: list[dict]) -> None:
    for case in cases:
        print(
            f"\nbatch {case['batch']}, budget {case['budget']}: on-demand "
            f"{case['on_demand_tpot_ms']:.2f} ms, bound ΔT {case['bound_ms']:.2f} ms"
        )
        print(
            f"{'mode':<24}{'TPOT ms':>9}{'tok/s':>8}{'vs vanilla':>11}{'stall ms':>10}"
            f"{'recall':>8}{'saved ms':>10}{'of bound':>10}"
        )
        for r in case["rows"]:
            extra = ""
            if "stall_ms_per_step" in r:
                recall = f"{r['recall']:.2f}" if r["recall"] is not None else "-"
                share = f"{r['share_of_bound']:.0%}" if r["share_of_bound"] is not None else "-"
                extra = (
                    f"{r['stall_ms_per_step']:>10.2f}{recall:>8}{r['saved_ms']:>10.2f}{share:>10}"
                )
            print(
                f"{r['mode']:<24}{r['tpot_ms']:>9.2f}{r['tok_s']:>8.1f}"
                f"{r['speed_vs_vanilla']:>10.2f}x{extra}"
            )


if __name__ == "__main__":
    main()
