"""The quality budget: how well its estimates (accuracy loss, flip rate) match the
measured ones, where it makes each mode fall back, and what sampling costs.

    python benchmarks/quality.py [--model DIR] [--batches 1 8] [--windows 64]
                                 [--budget 0.25] [--samples 0.02 0.1] [--eager]
                                 [--confidences 0.5 0.9]
                                 [--parts estimate fallback cost] [--name quality]

One plugin engine (started with ``lowbit``: its INT4 copies are made at start only; the
final-norm tap is installed in every engine not started with ``quality: null``); modes
switch with ``reconfigure``.

1. **Estimate against measurement** (``estimate``). Per mode and batch size,
   ``--windows`` held-out windows (16 prompt tokens, 32 forced one decode step at a
   time, :func:`common.teacher_forced`) run with ``quality: {sample: 1.0,
   max_top1_flip: 1.0, max_accuracy_loss: null}`` (every token sampled, never
   switched). Estimated: the monitor's flip rate and accuracy loss. Measured: the share
   of positions whose top-1 token differs from ``fetch``'s at the same positions and
   batch size (teacher forcing keeps both on the real text), and ``1 - accuracy /
   fetch's accuracy`` (accuracy: top-1 = the real next token).
2. **Fallback** (``fallback``). The same windows under the default accuracy budget
   (0.02), deciding sooner than the default (``sample`` 0.5, ``window`` 50: a decision
   every 100 decode tokens of a batch class), judged at each of ``--confidences`` (0.5:
   the point estimate; 0.9: the default one-sided bound): the accuracy kept against
   ``fetch``, the share of decode passes run exactly, and the run's wall time against
   the mode's without a budget (the same windows, teacher-forced one decode step at a
   time: mostly decode), per mode and batch size.
3. **Cost** (``cost``). Per mode and batch size, the decode step time
   (``common.step_seconds``: prefill and request overheads cancel) without a budget,
   with ``sample`` in ``--samples`` (sampling only, no switch), and with the default
   budget, as ratios to the mode without a budget, with the share of decode passes run
   exactly. No link is emulated: a copy costs what the memcpy costs on this machine.

Writes ``benchmarks/results/quality.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS,
    command_line,
    default_calibration,
    held_out_prompts,
    held_out_windows,
    model_of,
    step_seconds,
    teacher_forced,
    write_result,
)

from vllm_specexpert.tools.harness import start_engine, stop_engine

PROMPT_TOKENS, FORCED_TOKENS = 16, 32
MODES = {
    "speculate quasi_hidden": {"miss_policy": "speculate", "predictor": "quasi_hidden"},
    "buddy": {"miss_policy": "buddy", "predictor": "none"},
    "random": {"miss_policy": "random", "predictor": "none"},
    "drop": {"miss_policy": "drop", "predictor": "none"},
    "lowbit": {"miss_policy": "lowbit", "predictor": "none"},
}
MEASURE_ONLY = {"sample": 1.0, "max_top1_flip": 1.0, "max_accuracy_loss": None}
FALLBACK = {"sample": 0.5, "window": 50}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the embedded model)")
    parser.add_argument("--calibration")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--samples", type=float, nargs="+", default=[0.02, 0.1])
    parser.add_argument(
        "--confidences",
        type=float,
        nargs="+",
        default=[0.5, 0.9],
        help="quality.confidence values the fallback part judges at (0.5: point estimate)",
    )
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="enforce_eager (default: compiled)")
    parser.add_argument("--name", default="quality", help="result file name")
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["estimate", "fallback", "cost"],
        choices=["estimate", "fallback", "cost"],
    )
    args = parser.parse_args()

    import vllm_specexpert
    from vllm_specexpert.tools.teacher_forcing import TeacherForcing

    model = model_of(args)
    calibration = args.calibration or default_calibration(model)
    llm = start_engine(
        model,
        {
            "budget": args.budget,
            "calibration": calibration,
            "miss_policy": "lowbit",
            "quality": MEASURE_ONLY,
        },
        eager=args.eager,
        max_model_len=512,
        max_num_seqs=max(args.batches),
        logits_processors=[TeacherForcing],
    )
    windows = held_out_windows(args.windows, PROMPT_TOKENS + FORCED_TOKENS, "validation")
    truth = [t for w in windows for t in w[PROMPT_TOKENS:]]

    def accuracy(top1: list[int]) -> float:
        return sum(a == b for a, b in zip(top1, truth, strict=True)) / len(truth)

    def passes(stats: dict) -> int:
        return max(max(la["decode"]["calls"] for la in stats["layers"].values()), 1)

    estimate_rows, fallback_rows = [], []
    for batch in args.batches if {"estimate", "fallback"} & set(args.parts) else ():
        vllm_specexpert.reconfigure(llm, miss_policy="fetch", predictor="none", quality=None)
        exact = teacher_forced(llm, windows, PROMPT_TOKENS, batch)["top1"]
        for name, mode in MODES.items():
            if "estimate" in args.parts:
                vllm_specexpert.reconfigure(llm, **mode, quality=MEASURE_ONLY)
                top1 = teacher_forced(llm, windows, PROMPT_TOKENS, batch)["top1"]
                quality = vllm_specexpert.get_stats(llm)[0]["quality"]
                flips = sum(a != b for a, b in zip(top1, exact, strict=True))
                row = {
                    "batch": batch,
                    "mode": name,
                    "measured": flips / len(exact),
                    "estimated": quality["top1_flip_rate"],
                    "kl_mean": quality["kl_mean"],
                    "measured_accuracy_loss": 1 - accuracy(top1) / accuracy(exact),
                    "estimated_accuracy_loss": quality["accuracy_loss"],
                    "sampled_tokens": quality["sampled_tokens"],
                    "positions": len(exact),
                }
                estimate_rows.append(row)
                print(
                    f"batch {batch:>3} {name:<24} flips measured {row['measured']:.3f} "
                    f"estimated {row['estimated']:.3f}; accuracy loss measured "
                    f"{row['measured_accuracy_loss']:.3f} estimated "
                    f"{row['estimated_accuracy_loss']:.3f} (KL {row['kl_mean']:.3f})",
                    flush=True,
                )
            if "fallback" in args.parts:
                vllm_specexpert.reconfigure(llm, **mode, quality=None)
                started = time.perf_counter()
                alone = accuracy(teacher_forced(llm, windows, PROMPT_TOKENS, batch)["top1"])
                alone_s = time.perf_counter() - started
            for confidence in args.confidences if "fallback" in args.parts else ():
                budget = {**FALLBACK, "confidence": confidence}
                vllm_specexpert.reconfigure(llm, **mode, quality=budget)
                started = time.perf_counter()
                top1 = teacher_forced(llm, windows, PROMPT_TOKENS, batch)["top1"]
                run_s = time.perf_counter() - started
                stats = vllm_specexpert.get_stats(llm)[0]
                quality = stats["quality"]
                row = {
                    "batch": batch,
                    "mode": name,
                    "quality": budget,
                    "confidence": confidence,
                    "kept": accuracy(top1) / accuracy(exact),
                    "kept_alone": alone / accuracy(exact),
                    "exact_pass_share": quality["exact_passes"] / passes(stats),
                    "switches_to_exact": quality["switches_to_exact"],
                    "switches_to_approximate": quality["switches_to_approximate"],
                    "estimated_accuracy_loss": quality["accuracy_loss"],
                    "run_s": run_s,
                    "alone_run_s": alone_s,
                    "time_ratio_to_alone": run_s / alone_s,
                }
                fallback_rows.append(row)
                print(
                    f"batch {batch:>3} {name:<24} budget at {confidence:.0%}: kept "
                    f"{row['kept']:.3f} (alone {row['kept_alone']:.3f}), exact passes "
                    f"{row['exact_pass_share']:.2f}, {row['time_ratio_to_alone']:.2f}x "
                    "the time alone",
                    flush=True,
                )

    prompts_by_batch = {b: held_out_prompts(b) for b in args.batches if "cost" in args.parts}
    cost_rows = []
    settings = {
        "none": None,
        **{f"sample {s}": {**MEASURE_ONLY, "sample": s} for s in args.samples},
        "budget 0.02 (default)": {},
    }
    for batch, prompts in prompts_by_batch.items():
        for name, mode in MODES.items():
            base = None
            for label, quality in settings.items():
                vllm_specexpert.reconfigure(llm, **mode, quality=quality)
                decode, first = step_seconds(llm, prompts, args.decode_tokens, args.repeats)
                stats = vllm_specexpert.get_stats(llm)[0]
                base = base or decode
                q = stats.get("quality", {})
                row = {
                    "batch": batch,
                    "mode": name,
                    "quality": label,
                    "decode_step_ms": decode * 1e3,
                    "first_token_ms": first * 1e3,
                    "decode_ratio": decode / base,
                    "exact_pass_share": q.get("exact_passes", 0) / passes(stats),
                    "shadow_ms_per_pass": q.get("shadow_s", 0.0) * 1e3 / passes(stats),
                }
                cost_rows.append(row)
                print(
                    f"batch {batch:>3} {name:<24} {label:<22} decode step "
                    f"{row['decode_step_ms']:.2f} ms ({row['decode_ratio']:.2f}x), exact "
                    f"passes {row['exact_pass_share']:.2f}",
                    flush=True,
                )
    stop_engine(llm)
    payload = {
        "model": model,
        "calibration": calibration,
        "budget": args.budget,
        "windows": args.windows,
        "prompt_tokens": PROMPT_TOKENS,
        "forced_tokens": FORCED_TOKENS,
        "eager": args.eager,
        "modeled": None,
        "estimate": estimate_rows,
        "fallback": fallback_rows,
        "cost": cost_rows,
    }
    path = write_result(args.name, payload)
    if estimate_rows:
        plot(
            estimate_rows,
            RESULTS / f"{args.name}.png",
            f"{Path(model).name}, budget {args.budget}, {args.windows} windows x "
            f"{FORCED_TOKENS} forced tokens\n{command_line()}",
        )
    print(f"wrote {path}\ncommand: {command_line()}")


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("measured", "estimated", "top-1 flip rate"),
        ("measured_accuracy_loss", "estimated_accuracy_loss", "accuracy loss"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 5))
    for ax, (measured, estimated, what) in zip(axes, panels, strict=True):
        for batch in sorted({r["batch"] for r in rows}):
            mine = [r for r in rows if r["batch"] == batch]
            ax.scatter(
                [r[measured] for r in mine],
                [r[estimated] for r in mine],
                label=f"{batch} sequences per step",
            )
            for r in mine:
                ax.annotate(r["mode"], (r[measured], r[estimated]), fontsize=7)
        values = [v for r in rows for v in (r[measured], r[estimated])]
        low, top = min(0.0, *values), max(values) * 1.1
        ax.plot([low, top], [low, top], color="grey", linewidth=0.8, label="estimate = measured")
        ax.set_xlabel(f"measured {what} (teacher-forced, against fetch)")
        ax.set_ylabel(f"quality monitor's estimated {what}")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
