"""What the approximate modes cost in accuracy at serving batch sizes.

    python benchmarks/batched_accuracy.py [--model DIR] [--batches 1 8 32 128]
                                          [--splits validation test] [--windows 128]
                                          [--budget 0.25] [--modes NAME...] [--eager]
                                          [--quality JSON]

One plugin engine (started with ``lowbit``, whose INT4 copies are made at load only
then, and with the calibration, estimator and analysis); modes switch with
``reconfigure``. For each split and batch size, ``--windows`` held-out windows (16
prompt tokens, 32 tokens forced one decode step at a time) are submitted ``batch`` at a
time, so every decode step of the run has ``batch`` sequences and every forced position
runs the mode's real decode path at that batch size
(:func:`common.teacher_forced`). Per mode: next-token accuracy, ``kept`` = accuracy /
exact's at the same batch size, ``top1=exact`` (same position, same batch), and mean
NLL. The exact reference is ``fetch`` at the same batch size (a batch's composition
can change vLLM's rounding, so each batch size has its own). No link is emulated:
misses are what they are at that budget, and nothing here is timed. Writes
``benchmarks/results/batched_accuracy.json`` and ``.png``.

With ``--quality '{"sample": 0.5, "window": 50}'`` every mode that changes the output
runs under that quality budget (the engine starts with it, so that the final-norm tap is
installed), each row also gives the share of decode passes the budget ran exactly, and
the files are ``batched_accuracy_quality.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS,
    add_predictor_arguments,
    command_line,
    default_calibration,
    estimator_artifacts,
    held_out_windows,
    model_of,
    teacher_forced,
    write_result,
)
from miss_policies import DEFAULT_BUDDY

from vllm_specexpert.tools.harness import start_engine, stop_engine

PROMPT_TOKENS, FORCED_TOKENS = 16, 32
MODES = {
    "fetch (exact)": {"miss_policy": "fetch", "predictor": "none"},
    "cpu": {"miss_policy": "cpu", "predictor": "none"},
    "speculate router": {"miss_policy": "speculate", "predictor": "router"},
    "speculate quasi_hidden": {"miss_policy": "speculate", "predictor": "quasi_hidden"},
    "speculate estimator": {"miss_policy": "speculate", "predictor": "estimator"},
    "speculate hybrid": {"miss_policy": "speculate", "predictor": "hybrid"},
    "buddy": {"miss_policy": "buddy", "predictor": "none", "buddy": DEFAULT_BUDDY},
    "auto_buddy": {"miss_policy": "auto_buddy", "predictor": "none", "buddy": DEFAULT_BUDDY},
    "random": {"miss_policy": "random", "predictor": "none", "buddy": DEFAULT_BUDDY},
    "drop": {"miss_policy": "drop", "predictor": "none"},
    "lowbit": {"miss_policy": "lowbit", "predictor": "none"},
}
"""Every approximate mode with its defaults (``cpu``: the equivalent reference)."""
UNCHANGED_OUTPUT = ("fetch (exact)", "cpu")
"""The modes a quality budget does not apply to."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_predictor_arguments(parser)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--splits", nargs="+", default=["validation", "test"])
    parser.add_argument("--windows", type=int, default=128)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument(
        "--modes", nargs="+", help="only these modes (the exact one is always run first)"
    )
    parser.add_argument("--eager", action="store_true", help="enforce_eager (default: compiled)")
    parser.add_argument(
        "--quality",
        type=json.loads,
        help="a quality budget (JSON) for every mode that changes the output",
    )
    args = parser.parse_args()
    name = "batched_accuracy_quality" if args.quality is not None else "batched_accuracy"

    import vllm_specexpert
    from vllm_specexpert.tools.teacher_forcing import TeacherForcing

    model = model_of(args)
    calibration = args.calibration or default_calibration(model)
    artifacts = estimator_artifacts(model, args)
    modes = {
        name: mode
        for name, mode in MODES.items()
        if name == "fetch (exact)" or (not args.modes or name in args.modes)
    }
    if not artifacts:
        modes = {n: m for n, m in modes.items() if m["predictor"] not in ("estimator", "hybrid")}
    llm = start_engine(
        model,
        {
            "budget": args.budget,
            "calibration": calibration,
            "miss_policy": "lowbit",
            **artifacts,
            "quality": args.quality,
        },
        eager=args.eager,
        max_model_len=512,
        max_num_seqs=max(args.batches),
        logits_processors=[TeacherForcing],
    )
    rows = []
    for split in args.splits:
        windows = held_out_windows(args.windows, PROMPT_TOKENS + FORCED_TOKENS, split)
        actual = [t for w in windows for t in w[PROMPT_TOKENS:]]
        for batch in args.batches:
            exact = None
            for label, mode in modes.items():
                quality = None if label in UNCHANGED_OUTPUT else args.quality
                vllm_specexpert.reconfigure(llm, **mode, quality=quality)
                forced = teacher_forced(llm, windows, PROMPT_TOKENS, batch)
                stats = vllm_specexpert.get_stats(llm)[0]
                exact = exact or forced
                n = len(actual)
                accuracy = sum(a == b for a, b in zip(forced["top1"], actual, strict=True)) / n
                exact_accuracy = sum(a == b for a, b in zip(exact["top1"], actual, strict=True)) / n
                row = {
                    "split": split,
                    "batch": batch,
                    "mode": label,
                    "output": stats["output"],
                    "accuracy": accuracy,
                    "kept": accuracy / exact_accuracy,
                    "top1_equal_exact": sum(
                        a == b for a, b in zip(forced["top1"], exact["top1"], strict=True)
                    )
                    / n,
                    "nll": -sum(forced["logprobs"]) / n,
                    "nll_delta": (sum(exact["logprobs"]) - sum(forced["logprobs"])) / n,
                    "positions": n,
                    "seconds": forced["seconds"],
                }
                if quality is not None:
                    passes = max(la["decode"]["calls"] for la in stats["layers"].values())
                    row["exact_pass_share"] = stats["quality"]["exact_passes"] / max(passes, 1)
                rows.append(row)
                print(
                    f"{split:<10} batch {batch:>3} {label:<24} acc {accuracy:.4f} kept "
                    f"{row['kept']:.3f} top1=exact {row['top1_equal_exact']:.3f} "
                    f"dNLL {row['nll_delta']:+.3f} ({forced['seconds']:.0f} s)"
                    + (f" exact passes {row['exact_pass_share']:.2f}" if quality else ""),
                    flush=True,
                )
    stop_engine(llm)
    payload = {
        "model": model,
        "calibration": calibration,
        **artifacts,
        "budget": args.budget,
        "windows": args.windows,
        "prompt_tokens": PROMPT_TOKENS,
        "forced_tokens": FORCED_TOKENS,
        "eager": args.eager,
        "modeled": None,
        "quality": args.quality,
        "rows": rows,
    }
    path = write_result(name, payload)
    plot(
        rows,
        RESULTS / f"{name}.png",
        f"{Path(model).name}, budget "
        f"{args.budget}, {args.windows} windows x {FORCED_TOKENS} forced tokens per split\n"
        f"{command_line()}",
    )
    print_markdown(rows)
    print(f"wrote {path}\ncommand: {command_line()}")


def print_markdown(rows: list[dict]) -> None:
    batches = sorted({r["batch"] for r in rows})
    for split in dict.fromkeys(r["split"] for r in rows):
        print(f"\n{split}: kept (top-1 = exact) [share of passes run exactly]\n")
        print("| mode | " + " | ".join(f"batch {b}" for b in batches) + " |")
        print("|---|" + "---|" * len(batches))
        for mode in dict.fromkeys(r["mode"] for r in rows):
            cells = {
                r["batch"]: f"{r['kept']:.3f} ({r['top1_equal_exact']:.3f})"
                + (f" [{r['exact_pass_share']:.2f}]" if "exact_pass_share" in r else "")
                for r in rows
                if r["split"] == split and r["mode"] == mode
            }
            print(f"| {mode} | " + " | ".join(cells.get(b, "-") for b in batches) + " |")


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = list(dict.fromkeys(r["split"] for r in rows))
    fig, axes = plt.subplots(1, len(splits), figsize=(6.5 * len(splits), 4.5), squeeze=False)
    for ax, split in zip(axes[0], splits, strict=True):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # 11 modes: tab10 would repeat
        for mode in dict.fromkeys(r["mode"] for r in rows):
            mine = sorted(
                (r["batch"], r["kept"]) for r in rows if r["split"] == split and r["mode"] == mode
            )
            ax.plot([b for b, _ in mine], [k for _, k in mine], marker="o", label=mode)
        ax.axhline(0.98, color="gray", linestyle="--", linewidth=1)
        ax.set(
            xscale="log",
            xlabel="sequences per decode step",
            ylabel="next-token accuracy / exact's",
            title=split,
        )
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
