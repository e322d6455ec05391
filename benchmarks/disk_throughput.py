"""`vllm bench throughput` on the disk tier, as a user runs it, at growing batches: the
model bigger than memory (``disk_vs_llamacpp``'s widened model and pack), each run its own
``specexpert vllm bench throughput`` process in a memory cgroup, the page cache dropped
before it. Real I/O; nothing modeled.

    python benchmarks/disk_throughput.py --memory-limit-gb 4 --ram-ratio 1.3 \\
        [--batches 1 8 32 128 256] [--output-len 16] [--work DIR] [--keep] \\
        [--name disk_throughput_mini]

Per batch ``B``: ``--num-prompts B --max-num-seqs B``, ``bench throughput``'s
``random`` dataset (32 random prompt tokens: vLLM 0.32's ``bench throughput`` takes no
``custom`` dataset, so not held-out code as ``disk_vs_llamacpp``'s), ``--output-len``
tokens each, ``budget: "auto"`` and no KV cache size (the plugin sizes both), in two modes:
``fetch`` (the default) and the compute ceiling (``random`` substitution: nothing read,
the same compute). Then one run with vLLM's defaults for the batch and the length
(``--num-prompts`` the largest batch, no ``--max-num-seqs``, no ``--max-model-len``):
what the plugin sizes from them.

Reports per run: output tok/s and total tok/s over the whole generate (prefill
included: ``bench throughput``'s own figure), the plugin's GB read per decode token and
per prompt token (its stats: the pack's reads), decode tokens, the disk's busy seconds,
the start line's budget (slots and region per layer, the KV cache and whom it holds),
and the cgroup's peak. Writes ``benchmarks/results/<name>.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, work_dir, write_outputs
from disk_vs_llamacpp import (
    CEILING_MODE,
    MODES,
    PROMPT_TOKENS,
    drop_page_cache,
    intermediate_for,
    packed,
    ram_bytes,
)
from memory_cgroup import MemoryCgroup

THROUGHPUT_MODES = {"fetch": MODES["fetch, LRFU"], "compute ceiling": MODES[CEILING_MODE]}
DEFAULTS = "vLLM's defaults"


def bench(args, work: Path, name: str, batch: int, settings: dict, sized: bool) -> dict:
    """One ``bench throughput`` process; ``sized``: the batch and length given (else
    vLLM's defaults)."""
    run = work / f"throughput-{name.replace(' ', '_')}-{batch}"
    run.mkdir(exist_ok=True)
    stats_path, result_path, log = run / "stats.json", run / "bench.json", run / "log.txt"
    for path in (stats_path, result_path):
        path.unlink(missing_ok=True)
    config = {
        "budget": "auto",
        "disk": {"path": str(work / "pack")},
        "stats_path": str(stats_path),
        "stats_interval_s": 3600,
        **settings,
    }
    sizes = ["--max-num-seqs", str(batch), "--max-model-len", "512"] if sized else []
    command = [
        sys.executable,
        "-m",
        "vllm_specexpert.cli",
        "vllm",
        "bench",
        "throughput",
        "--model",
        str(work / "model"),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(PROMPT_TOKENS),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(batch),
        *sizes,
        "--additional-config",
        json.dumps({"specexpert": config}),
        "--output-json",
        str(result_path),
    ]
    # As a user runs it: no KV cache size, one process for the engine (the stats file is
    # written when the engine closes).
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    cgroup = None
    if args.memory_limit_gb is not None:
        limit = round(args.memory_limit_gb * 1e9)
        cgroup = MemoryCgroup.create(limit, f"specexpert-throughput-{os.getpid()}")
    dropped = drop_page_cache()
    started = time.perf_counter()
    try:
        with log.open("w") as out:
            ended = subprocess.run(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=None if cgroup is None else cgroup.enter,
            )
        figures = cgroup.figures() if cgroup is not None else {}
    finally:
        if cgroup is not None:
            cgroup.remove()
    wall_s = time.perf_counter() - started
    text = log.read_text(errors="replace")
    result: dict = {
        "page_cache_dropped": dropped,
        "process_s": wall_s,
        "memory_cgroup": figures,
        "start_line": next((ln for ln in text.splitlines() if "MoE layers offloaded" in ln), None),
        # (the calling process's, where the KV cache is sized for the batch)
        "kv_line": next((ln for ln in text.splitlines() if "specexpert: KV cache" in ln), None),
        "command": " ".join(command),
    }
    if ended.returncode != 0 or not result_path.exists():
        kills = figures.get("oom_kills")
        result["died"] = "killed for memory" if kills else f"exit {ended.returncode}"
        result["log_tail"] = text[-2000:]
        return result
    measured = json.loads(result_path.read_text())
    stats = json.loads(stats_path.read_text())
    stats = stats[0] if isinstance(stats, list) else stats
    total = stats["total"]
    decode_tokens = max(stats["decode_tokens"], 1)
    prompt_tokens = measured["total_num_tokens"] - batch * args.output_len
    return {
        **result,
        "elapsed_s": measured["elapsed_time"],
        "output_tok_s": batch * args.output_len / measured["elapsed_time"],
        "total_tok_s": measured["tokens_per_second"],
        "decode_tokens": stats["decode_tokens"],
        "gb_read_per_decode_token": total["decode"]["bytes_loaded"] / decode_tokens / 1e9,
        "gb_read_per_prompt_token": total["prefill"]["bytes_loaded"] / max(prompt_tokens, 1) / 1e9,
        "disk_busy_s": stats["disk"].get("busy_s"),
        "budget": stats.get("budget"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="(default: the cache's directory of --name)")
    parser.add_argument("--ram-ratio", type=float, default=1.3)
    parser.add_argument("--intermediate", type=int, default=None, help="(instead of --ram-ratio)")
    parser.add_argument("--memory-limit-gb", type=float, help="each run in a memory cgroup")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--modes", nargs="+", choices=list(THROUGHPUT_MODES))
    parser.add_argument("--no-defaults-run", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the model and pack")
    parser.add_argument("--name", default="disk_throughput")
    args = parser.parse_args()
    work = args.work or work_dir(args.name.replace("_", "-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.intermediate is None:
        args.intermediate = intermediate_for(args.ram_ratio, ram_bytes(args))
    command = command_line()
    packed(args, work)
    runs: dict[str, dict] = {}
    for mode in args.modes or list(THROUGHPUT_MODES):
        runs[mode] = {}
        for batch in args.batches:
            row = bench(args, work, mode, batch, THROUGHPUT_MODES[mode], sized=True)
            runs[mode][str(batch)] = row
            print(f"{mode:16s} {batch:4d} seq: {summary(row)}", flush=True)
    if not args.no_defaults_run:
        batch = max(args.batches)
        row = bench(args, work, DEFAULTS, batch, THROUGHPUT_MODES["fetch"], sized=False)
        runs[DEFAULTS] = {str(batch): row}
        print(f"{DEFAULTS} {batch} prompts: {summary(row)}", flush=True)
    payload = {
        "real_io": True,
        "modeled": None,
        "intermediate": args.intermediate,
        "memory_limit_gb": args.memory_limit_gb,
        "output_len": args.output_len,
        "batches": args.batches,
        "runs": runs,
    }
    out = write_outputs(args.name, payload, markdown(payload, command), plot)
    if not args.keep:
        import shutil

        for part in ("model", "pack"):
            shutil.rmtree(work / part, ignore_errors=True)
    print(f"wrote {out}")
    print(f"command: {command}")


def summary(row: dict) -> str:
    if "died" in row:
        return f"died: {row['died']}"
    return (
        f"{row['output_tok_s']:.1f} output tok/s, {row['total_tok_s']:.1f} total tok/s, "
        f"{row['gb_read_per_decode_token']:.4f} GB per decode token"
    )


def markdown(payload: dict, command: str) -> str:
    batches, runs = payload["batches"], payload["runs"]

    def cell(mode: str, batch: int, key: str, digits: int) -> str:
        row = runs.get(mode, {}).get(str(batch), {})
        if "died" in row:
            return row["died"]
        return f"{row[key]:.{digits}f}" if key in row else "-"

    head = "| | " + " | ".join(f"{b} seq" for b in batches) + " |"
    rule = "|---|" + "---|" * len(batches)
    lines = [
        f"Real I/O, nothing modeled. `{command}`",
        "",
        f"`specexpert vllm bench throughput`, {payload['output_len']} output tokens a "
        "prompt, prefill included:",
        "",
        head,
        rule,
    ]
    lines.extend(
        f"| {mode}, output tok/s | "
        + " | ".join(cell(mode, b, "output_tok_s", 1) for b in batches)
        + " |"
        for mode in runs
        if mode != DEFAULTS
    )
    if {"fetch", "compute ceiling"} <= set(runs):
        ratios = []
        for b in batches:
            f, c = runs["fetch"].get(str(b), {}), runs["compute ceiling"].get(str(b), {})
            ok = "output_tok_s" in f and "output_tok_s" in c
            ratios.append(f"{f['output_tok_s'] / c['output_tok_s']:.2f}" if ok else "-")
        lines.append("| fetch / ceiling | " + " | ".join(ratios) + " |")
    lines.append(
        "| fetch, GB per decode token | "
        + " | ".join(cell("fetch", b, "gb_read_per_decode_token", 4) for b in batches)
        + " |"
    )
    lines.append(
        "| fetch, GB per prompt token | "
        + " | ".join(cell("fetch", b, "gb_read_per_prompt_token", 4) for b in batches)
        + " |"
    )
    lines.append("")
    lines.append("What the start line said (the residency and the budget's accounting):")
    lines.append("")
    for mode, rows in runs.items():
        for batch, row in rows.items():
            if row.get("start_line"):
                residency = row["start_line"].split("offloaded, ", 1)[-1].split("; ")[0]
                lines.append(f"- {mode}, {batch}: {residency}")
    if DEFAULTS in runs:
        ((batch, row),) = runs[DEFAULTS].items()
        lines += ["", f"{DEFAULTS}, {batch} prompts: {summary(row)}"]
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches, runs = payload["batches"], payload["runs"]
    figure, (speed, reads) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, rows in runs.items():
        if mode == DEFAULTS:
            continue
        xs = [b for b in batches if "output_tok_s" in rows.get(str(b), {})]
        speed.plot(xs, [rows[str(b)]["output_tok_s"] for b in xs], marker="o", label=mode)
        if mode == "fetch":
            reads.plot(
                xs, [rows[str(b)]["gb_read_per_decode_token"] for b in xs], marker="o", label=mode
            )
    for axes, label in ((speed, "output tok/s (prefill included)"), (reads, "GB per decode token")):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("sequences")
        axes.set_ylabel(label)
        axes.legend()
    figure.suptitle("bench throughput on the disk tier (real I/O)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
