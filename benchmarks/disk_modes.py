"""The disk tier in wall time: modes side by side on a model whose experts are read from
disk (real I/O, ``O_DIRECT``: nothing modeled, no page cache between the slots and the
disk), decode and prefill apart.

    python benchmarks/disk_modes.py [--work DIR] [--expert-mib 9] [--budget 0.25]
                                    [--batches 1 8] [--tokens 24] [--repeats 2]
                                    [--name disk_modes]

The model: the embedded model with its experts widened (``specexpert widen``) to
``--expert-mib`` MiB each (Qwen3-30B-A3B's bf16 expert is 9.0 MiB): its routing, and
the bytes of a large model's experts. Written to ``--work`` (default
``$SPECEXPERT_CACHE/disk-bench``) with its pack on first use and kept for the next run.

One plugin engine (compiled, vLLM's default), ``disk: {"path": ...}`` at ``--budget``;
each mode by ``reconfigure`` (caches rebuilt, counters zeroed), every batch of
held-out prompts: decode seconds per step (``(t(tokens) - t(1)) / (tokens - 1)``, so
prefill cancels out) and the prefill pass apart, then the disk's counters per decode
token: GB read, seconds the copies waited for reads, the throughput the disk gave
while a copy waited and while any read was in flight. This process's resident memory
after the start and after each mode (``VmRSS``), its peak (which includes the widening
of a new model and vLLM's profile pass, whose expert workspace grows with the
intermediate size), and the page cache's growth over the run (``/proc/meminfo``
``Cached``; the widening's writes go through it, the reads do not) are recorded.
Writes ``benchmarks/results/<name>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS,
    command_line,
    held_out_prompts,
    kib,
    timed_generate,
    work_dir,
    write_result,
)

MODES = {
    "fetch, LRU": {"miss_policy": "fetch", "cache": "lru", "predictor": "none"},
    "fetch, LFU": {"miss_policy": "fetch", "cache": "lfu", "predictor": "none"},
    "fetch + router prefetch, all": {
        "miss_policy": "fetch",
        "cache": "lru",
        "predictor": "router",
        "prefetch_filter": "all",
    },
    "fetch + router prefetch, cost filter": {
        "miss_policy": "fetch",
        "cache": "lru",
        "predictor": "router",
        "prefetch_filter": "cost",
    },
    "drop (approximate)": {"miss_policy": "drop", "cache": "lru", "predictor": "none"},
}
"""What runs without artifacts made for the widened model (the calibration, estimator
and path predictor are checked against the model they were made for, whose expert size
differs)."""


def widened_model(work: Path, expert_mib: float) -> Path:
    from vllm_specexpert.tools.embedded_model import TRAINED_MODEL_DIR
    from vllm_specexpert.tools.widen import widen_checkpoint

    model = work / f"model-{expert_mib:g}mib"
    if not (model / "config.json").exists():
        work.mkdir(parents=True, exist_ok=True)
        widen_checkpoint(TRAINED_MODEL_DIR, model, expert_mib=expert_mib)
    return model


def measure(llm, prompts: list[str], tokens: int, repeats: int) -> dict:
    import vllm_specexpert

    full, first = [], []
    vllm_specexpert.reset_stats(llm)
    for _ in range(repeats):
        full.append(timed_generate(llm, prompts, tokens))
        first.append(timed_generate(llm, prompts, 1))
    stats = vllm_specexpert.get_stats(llm)[0]
    decode_s = (min(full) - min(first)) / (tokens - 1)
    if decode_s <= 0:  # the 1-token runs' prefill varied more than the decode took
        decode_s = float("nan")
    decode_tokens = max(stats["decode_tokens"], 1)
    disk = stats["disk"]
    d = stats["total"]["decode"]
    return {
        "decode_s_per_step": decode_s,
        "decode_tok_s": len(prompts) / decode_s,
        "prefill_s": min(first),
        "decode_tokens": stats["decode_tokens"],
        "hit_rate": d["hit_rate"],
        "gb_read_per_decode_token": d["bytes_loaded"] / decode_tokens / 1e9,
        "stall_s_per_decode_token": d["stall_s"] / decode_tokens,
        "prefetched_per_decode_token": d["prefetched"] / decode_tokens,
        "prefetch_used_per_decode_token": d["prefetch_used"] / decode_tokens,
        "disk": disk,
        "output": stats["output"],
    }


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({int(b) for mode in results.values() for b in mode})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(results)
    for i, (mode, rows) in enumerate(results.items()):
        xs = [j + i * width for j in range(len(batches))]
        axes[0].bar(xs, [rows[str(b)]["decode_tok_s"] for b in batches], width, label=mode)
        axes[1].bar(
            xs, [rows[str(b)]["gb_read_per_decode_token"] for b in batches], width, label=mode
        )
    for ax, label in zip(
        axes, ("decode tok/s (real I/O)", "GB read per decode token"), strict=True
    ):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))])
        ax.set_xticklabels([f"{b} seq" for b in batches])
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=work_dir("disk-bench"))
    parser.add_argument("--expert-mib", type=float, default=9.0)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--name", default="disk_modes")
    args = parser.parse_args()
    if args.tokens < 2:
        parser.error("--tokens: at least 2 (decode time is t(tokens) - t(1))")

    model = widened_model(args.work, args.expert_mib)
    pack = args.work / f"pack-{args.expert_mib:g}mib"
    cached_before = kib("/proc/meminfo", "Cached")
    import vllm_specexpert
    from vllm_specexpert.tools.harness import start_engine

    started = time.perf_counter()
    llm = start_engine(
        str(model),
        {"budget": args.budget, "disk": {"path": str(pack), "residency": "slots"}},
        eager=False,
        max_model_len=512,
        max_num_seqs=max(args.batches),
    )
    start_s = time.perf_counter() - started
    prompts = held_out_prompts(max(args.batches))
    results: dict[str, dict[str, dict]] = {}
    rss: dict[str, float] = {"after start": kib("/proc/self/status", "VmRSS") / 1e6}
    for mode, settings in MODES.items():
        vllm_specexpert.reconfigure(llm, budget=args.budget, **settings)
        results[mode] = {}
        for batch in args.batches:
            timed_generate(llm, prompts[:batch], 2)  # warm after the rebuild
            row = measure(llm, prompts[:batch], args.tokens, args.repeats)
            results[mode][str(batch)] = row
            print(
                f"{mode:26s} {batch:2d} seq: decode {row['decode_tok_s']:6.2f} tok/s, "
                f"{row['gb_read_per_decode_token']:.3f} GB read/token, hit rate "
                f"{row['hit_rate']:.2f}, disk {row['disk']['waited_gbps']:.2f} GB/s while "
                f"waited, prefill {row['prefill_s']:.2f} s",
                flush=True,
            )
        rss[mode] = kib("/proc/self/status", "VmRSS") / 1e6
    stats = vllm_specexpert.get_stats(llm)[0]
    command = command_line()
    payload = {
        "real_io": True,
        "modeled": None,
        "model": str(model),
        "expert_mib": args.expert_mib,
        "expert_bytes": next(iter(stats["expert_bytes"].values())),
        "experts_bytes_total": stats["store_bytes"],
        "budget": args.budget,
        "slots_per_layer": next(iter(stats["slots_per_layer"].values())),
        "summary": stats["summary"],
        "engine_start_s": start_s,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "rss_after_gb": kib("/proc/self/status", "VmRSS") / 1e6,
        "rss_after_per_mode_gb": rss,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "page_cache_growth_gb": (kib("/proc/meminfo", "Cached") - cached_before) / 1e6,
        "results": results,
    }
    out = write_result(args.name, payload)
    plot(results, RESULTS / f"{args.name}.png", f"disk tier, real I/O: {command}")
    print(f"wrote {out} and {RESULTS / f'{args.name}.png'}")
    print(f"command: {command}")


if __name__ == "__main__":
    main()
