"""Decode TPOT and tok/s of the exact and equivalent modes beside vanilla vLLM.

    python benchmarks/tpot.py [--model DIR] [--eager] [--batches 1 4] [--budgets 0.5 0.25]
                              [--rounds 3] [--max-tokens 64]

Two engines run side by side in this process: vanilla vLLM (no plugin loaded) and the
plugin, which switches mode with ``reconfigure`` (no reload). Per batch size: the plugin
at budget 1.0, then at each budget on-demand loading (``fetch``), ``fetch`` with
quasi-hidden prefetch, ``cpu`` and ``auto``, once on this machine's memcpy (no link
emulated: measured) and once on an emulated link that makes one expert copy take
``--copy-compute-ratio`` times one MoE layer's decode compute, with the host
``host_slowdown`` (14) times slower than this CPU (MODELED, see ``common.emulated_link``).
Modes are measured in interleaved rounds and reported as medians and as ratios to
vanilla. Decode (TPOT) and prefill (time to the first token) are reported separately;
per-token counters are decode-only. Batch 4 is the demo's (``specexpert demo``), which
defaults to the fastest exact or equivalent mode found here. Writes
``benchmarks/results/tpot.json`` and ``tpot.png``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS,
    command_line,
    decode_figures,
    default_calibration,
    emulated_link,
    model_of,
    modeled,
    modeled_label,
    prefill_figures,
    step_seconds,
    timed_generate,
    write_result,
)

from vllm_specexpert.tools.harness import start_engine, stop_engine

PROMPTS = [
    'def parse_arguments(argv):\n    """Parse the command line."""\n',
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "# Read a file and count its lines\n",
]
NO_LINK = {"bandwidth_gbps": None, "latency_us": 0.0}
MODES = {
    "fetch": {"miss_policy": "fetch", "predictor": "none"},
    "fetch + prefetch": {"miss_policy": "fetch", "predictor": "quasi_hidden"},
    "cpu": {"miss_policy": "cpu", "predictor": "none"},
    "auto": {"miss_policy": "auto", "predictor": "none"},
}
"""The exact (fetch) and equivalent (cpu, auto) modes; prefetch uses quasi_hidden."""


def plugin_modes(budgets: list[float], link: dict) -> list[tuple[str, dict]]:
    modes = [("budget 1.0", {"budget": 1.0, "link": NO_LINK, **MODES["fetch"]})]
    for emulated, link_config in ((False, NO_LINK), (True, link)):
        for budget in budgets:
            for name, mode in MODES.items():
                label = f"{name} {budget}" + (" [modeled link]" if emulated else "")
                modes.append((label, {"budget": budget, "link": link_config, **mode}))
    return modes


def plot(cases: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(cases), 1, figsize=(11, 4.2 * len(cases)), squeeze=False)
    for ax, case in zip(axes[:, 0], cases, strict=True):
        rows = case["rows"]
        colors = [
            "#555" if r["mode"] == "vanilla" else "#c44" if "modeled" in r["mode"] else "#3b7dd8"
            for r in rows
        ]
        bars = ax.bar(range(len(rows)), [r["tok_s"] for r in rows], color=colors)
        for bar, row in zip(bars, rows, strict=True):
            ax.annotate(
                f"{row['speed_vs_vanilla']:.2f}x",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=6,
            )
        ax.set_xticks(
            range(len(rows)), [r["mode"] for r in rows], rotation=40, ha="right", fontsize=7
        )
        ax.set_ylabel(f"decode tok/s (batch {case['batch']})")
        ax.set_title(
            f"batch {case['batch']}: blue measured on this CPU, red MODELED "
            "(emulated link and host)",
            fontsize=8,
        )
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def measure_batch(vanilla, plugin, prompts, modes, args) -> dict:
    import vllm_specexpert

    decode: dict[str, list[float]] = {"vanilla": []}
    first: dict[str, list[float]] = {"vanilla": []}
    stats: dict[str, dict] = {}
    for round_index in range(args.rounds):
        timed_generate(vanilla, prompts, 4)
        step, ttft = step_seconds(vanilla, prompts, args.max_tokens, args.repeats)
        decode["vanilla"].append(step)
        first["vanilla"].append(ttft)
        for name, config in modes:
            vllm_specexpert.reconfigure(plugin, **config)
            timed_generate(plugin, prompts, 4)  # warm-up after the cache rebuild
            vllm_specexpert.reset_stats(plugin)
            step, ttft = step_seconds(plugin, prompts, args.max_tokens, args.repeats)
            decode.setdefault(name, []).append(step)
            first.setdefault(name, []).append(ttft)
            stats[name] = vllm_specexpert.get_stats(plugin)[0]  # the last round's
        print(
            f"batch {len(prompts)} round {round_index + 1}/{args.rounds}: "
            + ", ".join(f"{n} {statistics.median(s) * 1e3:.2f} ms" for n, s in decode.items()),
            flush=True,
        )
    base = statistics.median(decode["vanilla"])
    rows = []
    for name, values in decode.items():
        step = statistics.median(values)
        row = {
            "mode": name,
            "tpot_ms": step * 1e3,
            "tok_s": len(prompts) / step,
            "speed_vs_vanilla": base / step,
            "tpot_samples_ms": [v * 1e3 for v in values],
            "first_token_ms": statistics.median(first[name]) * 1e3,
        }
        if name in stats:
            row.update(
                output=stats[name]["output"],
                modeled="modeled" in name,
                decode=decode_figures(stats[name]),
                prefill=prefill_figures(stats[name]),
            )
        rows.append(row)
    # Per budget, the fastest exact or equivalent mode on this machine (no emulation).
    fastest = {}
    for budget in args.budgets:
        measured = [
            r
            for r in rows
            if r.get("output") in ("exact", "equivalent")
            and not r["modeled"]
            and r["mode"].endswith(f" {budget}")
        ]
        fastest[str(budget)] = max(measured, key=lambda r: r["tok_s"])["mode"]
    return {"batch": len(prompts), "rows": rows, "fastest_exact_or_equivalent_measured": fastest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the embedded model)")
    parser.add_argument("--calibration", help="calibration directory (default: made on first use)")
    parser.add_argument("--eager", action="store_true", help="enforce_eager (default: compiled)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--copy-compute-ratio", type=float, default=2.7)
    parser.add_argument("--latency-us", type=float, default=10.0)
    parser.add_argument("--name", default="tpot")
    args = parser.parse_args()

    import vllm_specexpert

    model = model_of(args)
    calibration = args.calibration or default_calibration(model)
    vanilla = start_engine(model, None, eager=args.eager)
    plugin = start_engine(model, {"budget": 1.0, "calibration": calibration}, eager=args.eager)

    # Calibrate the emulated link from vanilla's per-layer batch-1 decode time.
    timed_generate(vanilla, PROMPTS[:1], 8)
    vanilla_step, _ = step_seconds(vanilla, PROMPTS[:1], args.max_tokens, args.repeats)
    info = vllm_specexpert.get_stats(plugin)[0]
    expert_bytes = next(iter(info["expert_bytes"].values()))
    layer_s = vanilla_step / len(info["layers"])
    link = emulated_link(layer_s, expert_bytes, args.copy_compute_ratio, args.latency_us)
    print(
        f"vanilla {vanilla_step * 1e3:.2f} ms/step, {layer_s * 1e6:.0f} us/layer; "
        f"expert {expert_bytes} B -> emulated link {link['bandwidth_gbps']:.4f} GB/s "
        f"+ {args.latency_us} us per copy",
        flush=True,
    )

    modes = plugin_modes(args.budgets, link)
    cases = [
        measure_batch(vanilla, plugin, (PROMPTS * batch)[:batch], modes, args)
        for batch in args.batches
    ]
    stop_engine(plugin)
    stop_engine(vanilla)

    overhead = {
        case["batch"]: case["rows"][1]["tpot_ms"] / case["rows"][0]["tpot_ms"] - 1 for case in cases
    }
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
            vanilla_layer_us=layer_s * 1e6,
            applies_to="rows whose mode says [modeled link]",
        ),
        "plugin_overhead_at_budget_1": overhead,
        "cases": cases,
    }
    path = write_result(args.name, payload)
    plot(
        cases,
        RESULTS / f"{args.name}.png",
        f"{Path(model).name}, {'eager' if args.eager else 'compiled'}; red bars "
        f"{modeled_label(link, args.copy_compute_ratio)}\n{command_line()}",
    )

    for case in cases:
        print(
            f"\nbatch {case['batch']}\n{'mode':<34}{'TPOT ms':>9}{'tok/s':>8}"
            f"{'vs vanilla':>11}{'1st tok ms':>11}{'hit rate':>9}{'MB/tok':>8}"
            f"{'stall ms/tok':>13}{'host ms/tok':>12}"
        )
        for r in case["rows"]:
            d = r.get("decode")
            extra = ""
            if d:
                extra = (
                    f"{d['hit_rate']:>9.2%}{d['mb_per_token']:>8.3f}"
                    f"{d['stall_ms_per_token']:>13.3f}{d['host_ms_per_token']:>12.3f}"
                )
            print(
                f"{r['mode']:<34}{r['tpot_ms']:>9.2f}{r['tok_s']:>8.1f}"
                f"{r['speed_vs_vanilla']:>10.2f}x{r['first_token_ms']:>11.1f}{extra}"
            )
        print(
            "fastest exact/equivalent mode measured (no emulation), per budget: "
            + ", ".join(case["fastest_exact_or_equivalent_measured"].values())
        )
    print(
        "\nplugin overhead at budget 1.0: "
        + ", ".join(f"batch {b}: {v:+.1%}" for b, v in overhead.items())
    )
    print(f"wrote {path} and {path.with_suffix('.png')}\ncommand: {command_line()}")


if __name__ == "__main__":
    main()
