"""Batch-1 decode TPOT and tok/s: vanilla vLLM vs the plugin at several budgets.

    python benchmarks/tpot.py [--model DIR] [--eager] [--rounds 3] [--max-tokens 64]

Two engines run side by side in this process: vanilla vLLM (no plugin loaded) and the
plugin, which switches mode with ``reconfigure`` (no reload). Modes are measured in
interleaved rounds and reported as medians and as ratios to vanilla, since this machine
is noisy. The emulated link is calibrated to reproduce a GPU box's copy/compute ratio:
one expert copy takes ``--copy-compute-ratio`` times one MoE layer's decode compute
(see ``common.emulated_link``). Writes ``benchmarks/results/tpot.json`` and ``tpot.png``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RESULTS,
    command_line,
    decode_step_seconds,
    emulated_link,
    timed_generate,
    write_result,
)

from vllm_specexpert.tools.harness import start_engine, stop_engine  # noqa: E402

PROMPT = "def parse_arguments(argv):\n    \"\"\"Parse the command line.\"\"\"\n"
NO_LINK = {"bandwidth_gbps": None, "latency_us": 0.0}


def plugin_modes(link: dict) -> list[tuple[str, dict]]:
    return [
        ("plugin budget 1.0", {"budget": 1.0, "link": NO_LINK}),
        ("fetch 0.5", {"budget": 0.5, "link": NO_LINK}),
        ("fetch 0.25", {"budget": 0.25, "link": NO_LINK}),
        ("fetch 0.5 + link", {"budget": 0.5, "link": link}),
        ("fetch 0.25 + link", {"budget": 0.25, "link": link}),
    ]


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [r["mode"] for r in rows]
    values = [r["tok_s"] for r in rows]
    bars = ax.bar(names, values, color=["#555"] + ["#3b7dd8"] * (len(rows) - 1))
    for bar, row in zip(bars, rows):
        ax.annotate(f"{row['tok_s']:.0f}\n{row['speed_vs_vanilla']:.2f}x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("decode tok/s (batch 1)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, max(values) * 1.2)
    plt.xticks(rotation=20, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the embedded model)")
    parser.add_argument("--eager", action="store_true", help="enforce_eager (default: compiled)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--copy-compute-ratio", type=float, default=2.7)
    parser.add_argument("--latency-us", type=float, default=10.0)
    parser.add_argument("--name", default="tpot")
    args = parser.parse_args()

    import vllm_specexpert
    from vllm_specexpert.tools.fixtures import DEFAULT_MODEL, model_path

    model = args.model or str(model_path(DEFAULT_MODEL))
    prompts = [PROMPT]
    vanilla = start_engine(model, None, eager=args.eager)
    plugin = start_engine(model, {"budget": 1.0}, eager=args.eager)

    # Calibrate the emulated link from vanilla's per-layer decode time.
    timed_generate(vanilla, prompts, 8)
    vanilla_step = decode_step_seconds(vanilla, prompts, args.max_tokens, args.repeats)
    info = vllm_specexpert.get_stats(plugin)[0]
    num_layers = len(info["layers"])
    expert_bytes = next(iter(info["expert_bytes"].values()))
    layer_s = vanilla_step / num_layers
    link = emulated_link(layer_s, expert_bytes, args.copy_compute_ratio, args.latency_us)
    bandwidth_gbps = link["bandwidth_gbps"]
    print(f"vanilla {vanilla_step * 1e3:.2f} ms/step, {layer_s * 1e6:.0f} us/layer; "
          f"expert {expert_bytes} B -> emulated link {bandwidth_gbps:.3f} GB/s "
          f"+ {args.latency_us} us per copy")

    modes = plugin_modes(link)
    samples: dict[str, list[float]] = {"vanilla": []}
    stats: dict[str, list[dict]] = {}
    for round_index in range(args.rounds):
        timed_generate(vanilla, prompts, 8)
        samples["vanilla"].append(
            decode_step_seconds(vanilla, prompts, args.max_tokens, args.repeats))
        for name, config in modes:
            vllm_specexpert.reconfigure(plugin, **config)
            timed_generate(plugin, prompts, 8)  # warm-up after the cache rebuild
            vllm_specexpert.reset_stats(plugin)
            samples.setdefault(name, []).append(
                decode_step_seconds(plugin, prompts, args.max_tokens, args.repeats))
            stats.setdefault(name, []).append(vllm_specexpert.get_stats(plugin)[0])
        print(f"round {round_index + 1}/{args.rounds}: " + ", ".join(
            f"{n} {statistics.median(s) * 1e3:.2f} ms" for n, s in samples.items()))
    stop_engine(plugin)
    stop_engine(vanilla)

    base = statistics.median(samples["vanilla"])
    # Tokens generated per measurement: repeats x (max_tokens + 1).
    tokens_per_sample = args.repeats * (args.max_tokens + 1)
    rows = []
    for name, values in samples.items():
        step = statistics.median(values)
        row = {"mode": name, "tpot_ms": step * 1e3, "tok_s": 1 / step,
               "speed_vs_vanilla": base / step, "tpot_samples_ms": [v * 1e3 for v in values]}
        if name in stats:
            last = stats[name][-1]
            row.update(
                hit_rate=last["total"]["hit_rate"],
                mb_moved_per_token=last["total"]["bytes_loaded"] / tokens_per_sample / 1e6,
                stall_ms_per_token=last["total"]["stall_s"] / tokens_per_sample * 1e3,
                slots_per_layer=next(iter(last["slots_per_layer"].values())),
            )
        rows.append(row)

    overhead = rows[1]["tpot_ms"] / rows[0]["tpot_ms"] - 1
    payload = {
        "model": model, "eager": args.eager, "batch": 1, "max_tokens": args.max_tokens,
        "rounds": args.rounds, "repeats": args.repeats,
        "emulated_link": {**link, "copy_compute_ratio": args.copy_compute_ratio,
                          "expert_bytes": expert_bytes, "vanilla_layer_us": layer_s * 1e6},
        "plugin_overhead_at_budget_1": overhead,
        "rows": rows,
    }
    path = write_result(args.name, payload)
    title = (f"{Path(model).name}, batch 1, {'eager' if args.eager else 'compiled'}; "
             f"link {bandwidth_gbps:.2f} GB/s (copy/compute {args.copy_compute_ratio})\n"
             f"{command_line()}")
    plot(rows, RESULTS / f"{args.name}.png", title)

    print(f"\n{'mode':<20}{'TPOT ms':>9}{'tok/s':>8}{'vs vanilla':>11}{'hit rate':>9}"
          f"{'MB/tok':>8}{'stall ms/tok':>13}")
    for r in rows:
        extra = (f"{r['hit_rate']:>9.2%}{r['mb_moved_per_token']:>8.2f}"
                 f"{r['stall_ms_per_token']:>13.3f}") if "hit_rate" in r else ""
        print(f"{r['mode']:<20}{r['tpot_ms']:>9.2f}{r['tok_s']:>8.1f}"
              f"{r['speed_vs_vanilla']:>10.2f}x{extra}")
    print(f"\nplugin overhead at budget 1.0: {overhead:+.1%}")
    print(f"wrote {path} and {path.with_suffix('.png')}\ncommand: {command_line()}")


if __name__ == "__main__":
    main()
