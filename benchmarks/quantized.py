"""Quantized checkpoints beside bf16 under ``fetch``: bytes per expert, slow-tier memory,
decode tok/s and MB per decode token, and the dequantize cost per expert.

    python benchmarks/quantized.py [--model DIR] [--formats awq gptq w4a16 fp8]
                                   [--budgets 0.5 0.25] [--batches 1 32]
                                   [--max-tokens 32] [--repeats 2] [--eager]

The model (default: the embedded one) and its experts quantized by ``specexpert
quantize`` (round-to-nearest, largest group of 128/64/32 that divides both projections;
FP8 with per-tensor scales), each served by its own plugin engine, one after the other,
with the same emulated link: it is derived once from the bf16 model (one bf16 expert copy
= ``--copy-compute-ratio`` times one MoE layer's batch-1 decode compute of vanilla vLLM
on the bf16 model, see ``common.emulated_link``), so a format that moves fewer bytes
waits less. Decode tok/s and MB per decode token are therefore MODELED (the link's GB/s
is the constant); the dequantize cost per expert is measured on this CPU (it runs on
every copy, in the copying thread). Decode and prefill are reported apart; greedy
agreement with the bf16 model shows what quantization itself changes. Writes
``benchmarks/results/quantized.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS,
    add_engine_arguments,
    agreement,
    command_line,
    decode_figures,
    greedy_tokens,
    held_out_prompts,
    link_like_a_gpu_box,
    model_of,
    modeled,
    modeled_label,
    prefill_figures,
    step_seconds,
    timed_generate,
    write_result,
)

from vllm_specexpert.tools.harness import (
    decode_seconds,
    start_engine,
    stop_engine,
)


def measure(llm, name: str, link: dict, prompts: dict[int, list[str]], args) -> list[dict]:
    import vllm_specexpert

    rows = []
    info = vllm_specexpert.get_stats(llm)[0]
    for budget in args.budgets:
        for batch, batch_prompts in prompts.items():
            vllm_specexpert.reconfigure(llm, budget=budget, link=link, miss_policy="fetch")
            timed_generate(llm, batch_prompts, 4)  # warm-up after the cache rebuild
            vllm_specexpert.reset_stats(llm)
            step, first = step_seconds(llm, batch_prompts, args.max_tokens, args.repeats)
            stats = vllm_specexpert.get_stats(llm)[0]
            row = {
                "format": name,
                "budget": budget,
                "batch": batch,
                "tok_s": batch / step,
                "tpot_ms": step * 1e3,
                "first_token_ms": first * 1e3,
                "expert_bytes": next(iter(info["expert_bytes"].values())),
                "slot_bytes": next(iter(info["slot_bytes"].values())),
                "store_bytes": info["store_bytes"],
                "decode": decode_figures(stats),
                "prefill": prefill_figures(stats),
            }
            print(
                f"{name} budget {budget} batch {batch}: {row['tok_s']:.1f} tok/s, "
                f"{row['decode']['mb_per_token']:.3f} MB/token",
                flush=True,
            )
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(parser, "quantized")
    parser.add_argument("--formats", nargs="+", default=["awq", "gptq", "w4a16", "fp8"])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    import json
    import os

    from vllm_specexpert.tools import quantize

    # apply_model sends decode_seconds to this machine's own engine processes, by name.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    model = model_of(args)
    config = json.loads((Path(model) / "config.json").read_text())
    hidden = config["hidden_size"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    group = next(g for g in (128, 64, 32) if hidden % g == 0 and inter % g == 0)
    prompts = {b: held_out_prompts(b) for b in args.batches}
    work = Path(tempfile.mkdtemp(prefix="specexpert-quantized-"))

    vanilla = start_engine(model, None, eager=args.eager)
    reference = greedy_tokens(vanilla, prompts[max(args.batches)], 32)
    plugin = start_engine(model, {"budget": args.budgets[0]}, eager=args.eager)
    link, vanilla_step, bf16_bytes = link_like_a_gpu_box(vanilla, plugin, args)
    stop_engine(vanilla)
    rows = measure(plugin, "bf16", link, prompts, args)
    quality = {"bf16": agreement(greedy_tokens(plugin, prompts[max(args.batches)], 32), reference)}
    dequantize = {"bf16": 0.0}
    stop_engine(plugin)
    for name in args.formats:
        fmt = quantize.make_format(name, group_size=group)
        out = work / name
        quantize.quantize_checkpoint(Path(model), out, fmt, name)
        llm = start_engine(str(out), {"budget": args.budgets[0]}, eager=args.eager)
        rows += measure(llm, name, link, prompts, args)
        quality[name] = agreement(greedy_tokens(llm, prompts[max(args.batches)], 32), reference)
        dequantize[name] = llm.apply_model(decode_seconds)[0]
        print(
            f"{name}: dequantize {dequantize[name] * 1e6:.0f} us per expert; greedy "
            f"agreement with bf16 {quality[name]}",
            flush=True,
        )
        stop_engine(llm)

    for row in rows:
        base = next(
            r
            for r in rows
            if r["format"] == "bf16" and r["budget"] == row["budget"] and r["batch"] == row["batch"]
        )
        row["speed_vs_bf16"] = row["tok_s"] / base["tok_s"]
        row["bytes_vs_bf16"] = row["expert_bytes"] / base["expert_bytes"]
    payload = {
        "model": model,
        "eager": args.eager,
        "group_size": group,
        "max_tokens": args.max_tokens,
        "modeled": modeled(
            link,
            args.copy_compute_ratio,
            bf16_expert_bytes=bf16_bytes,
            vanilla_batch1_step_ms=vanilla_step * 1e3,
        ),
        "dequantize_us_per_expert": {k: v * 1e6 for k, v in dequantize.items()},
        "greedy_agreement_with_bf16": quality,
        "rows": rows,
    }
    path = write_result(args.name, payload)
    plot(
        rows,
        RESULTS / f"{args.name}.png",
        f"{Path(model).name}; tok/s {modeled_label(link, args.copy_compute_ratio)}\n"
        f"{command_line()}",
    )
    print_markdown(rows, dequantize)
    print(f"wrote {path} and {path.with_suffix('.png')}\ncommand: {command_line()}")


def print_markdown(rows: list[dict], dequantize: dict[str, float]) -> None:
    print(
        "| format | budget | batch | bytes/expert | x bf16 | slow tier MB | tok/s (modeled) "
        "| x bf16 | MB/decode token | dequantize us/expert |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['format']} | {r['budget']} | {r['batch']} | {r['expert_bytes']} | "
            f"{r['bytes_vs_bf16']:.3f} | {r['store_bytes'] / 1e6:.1f} | {r['tok_s']:.1f} | "
            f"{r['speed_vs_bf16']:.2f} | {r['decode']['mb_per_token']:.3f} | "
            f"{dequantize[r['format']] * 1e6:.0f} |"
        )


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["budget"], r["batch"]) for r in rows}, key=lambda c: (-c[0], c[1]))
    fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 4), squeeze=False)
    for ax, (budget, batch) in zip(axes[0], cases, strict=True):
        case = [r for r in rows if r["budget"] == budget and r["batch"] == batch]
        bars = ax.bar(
            [r["format"] for r in case],
            [r["tok_s"] for r in case],
            color=["#555" if r["format"] == "bf16" else "#c44" for r in case],
        )
        for bar, r in zip(bars, case, strict=True):
            ax.annotate(
                f"{r['speed_vs_bf16']:.2f}x\n{r['decode']['mb_per_token']:.2f} MB/t",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
        ax.set_title(f"budget {budget}, batch {batch}", fontsize=9)
        ax.set_ylabel("decode tok/s (MODELED link)")
    fig.suptitle(title, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
