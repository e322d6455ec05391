"""How fast this machine's disk reads whole experts: ``O_DIRECT`` against the page cache,
by queue depth and expert size, through the disk tier's own reader
(:mod:`vllm_specexpert.tiers.disk_reader`). Real I/O, nothing modeled.

    python benchmarks/disk_read.py [--dir DIR] [--file-gib 8] [--seconds 4]
                                   [--depths 1 2 4 8 16] [--expert-mib 9.0 2.25]
                                   [--name disk_read]

Writes a scratch file of ``--file-gib`` GiB of random bytes under ``--dir`` (default:
the temporary directory; removed at the end), then, per expert size, mode and
queue depth, reads records of that size at uniformly random aligned offsets for
``--seconds`` (or until every record of the file was read once), keeping ``depth``
reads in flight; no record is read twice in a run. Expert sizes: Qwen3-30B-A3B's bf16
expert (3 x 768 x 2048 x 2 bytes = 9.0 MiB) and an INT4 one (a quarter). Buffered reads
start cold: the file's pages are dropped from the page cache before each run
(``posix_fadvise(DONTNEED)``; no root needed). Then, per expert size, the cost of the
disk tier's per-read checksum (xxh3-64, hashed on the reader's thread as each record
arrives): reads at ``--checksum-depth`` with and without it, side by side, and the
seconds of a core it takes per GB read.
Writes ``benchmarks/results/<name>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, wait
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, command_line

from vllm_specexpert.tiers.disk_reader import ALIGN, DiskFile, DiskReader, aligned, aligned_buffer
from vllm_specexpert.tiers.expert_pack import checksum

CHUNK = 64 << 20


def write_scratch(path: Path, nbytes: int) -> float:
    """``nbytes`` of random data at ``path`` (synced); returns the write's GB/s."""
    chunk = os.urandom(CHUNK)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for at in range(0, nbytes, CHUNK):
            f.write(chunk[: min(CHUNK, nbytes - at)])
            chunk = chunk[1:] + chunk[:1]  # not the same bytes twice (no dedup)
        f.flush()
        os.fsync(f.fileno())
    return nbytes / (time.perf_counter() - start) / 1e9


def drop_cached(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(
    path: Path,
    direct: bool,
    depth: int,
    record: int,
    seconds: float,
    seed: int,
    checked: bool = False,
) -> dict:
    """``checked``: each record hashed on the reader's thread as it arrives, as the disk
    tier checks every read (its hashing seconds are counted)."""
    drop_cached(path)
    file = DiskFile(path, direct=direct)
    if file.direct != direct:
        raise SystemExit(f"{path}: O_DIRECT was refused by its filesystem")
    reader = DiskReader(file, depth)
    buffers = [aligned_buffer(record) for _ in range(depth)]
    # Distinct records in random order: no read finds what an earlier one brought in.
    offsets = [i * aligned(record) for i in range(file.size // aligned(record))]
    random.Random(seed).shuffle(offsets)
    pending = {}
    latencies = []
    hashing: list[float] = []

    def check(buffer) -> None:
        started = time.perf_counter()
        checksum(buffer[:record].numpy().data, "model.layers.0.mlp.experts", 0, "w13_weight")
        hashing.append(time.perf_counter() - started)

    start = time.perf_counter()
    while (offsets and time.perf_counter() - start < seconds) or pending:
        while offsets and len(pending) < depth and time.perf_counter() - start < seconds:
            buffer = next(b for b in buffers if all(b is not p[0] for p in pending.values()))
            then = partial(check, buffer) if checked else None
            job = reader.submit(buffer, offsets.pop(), record, then)
            pending[job] = (buffer, time.perf_counter())
        done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
        for future in done:
            future.result()
            latencies.append(time.perf_counter() - pending.pop(future)[1])
    elapsed = time.perf_counter() - start
    stats = reader.stats
    reader.close()
    latencies.sort()
    return {
        "direct": direct,
        "checked": checked,
        "depth": depth,
        "record_bytes": record,
        "reads": stats.reads,
        "gbps": stats.bytes / elapsed / 1e9,
        "busy_gbps": stats.throughput_gbps,
        "latency_ms_p50": latencies[len(latencies) // 2] * 1e3,
        "latency_ms_p90": latencies[int(len(latencies) * 0.9)] * 1e3,
        "hash_seconds": sum(hashing),
    }


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["record_bytes"] for r in results}, reverse=True)
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        for direct, style in ((True, "o-"), (False, "s--")):
            rows = [r for r in results if r["record_bytes"] == size and r["direct"] == direct]
            ax.plot(
                [r["depth"] for r in rows],
                [r["gbps"] for r in rows],
                style,
                label="O_DIRECT" if direct else "page cache (cold)",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("queue depth (reads in flight)")
        ax.set_ylabel("GB/s (real I/O)")
        ax.set_title(f"{size / 2**20:.2f} MiB records")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--file-gib", type=float, default=8.0)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--expert-mib", type=float, nargs="+", default=[9.0, 2.25])
    parser.add_argument(
        "--checksum-depth",
        type=int,
        default=4,
        help="queue depth of the side-by-side of reads with and without the per-read "
        "checksum (the disk tier's default depth)",
    )
    parser.add_argument("--name", default="disk_read")
    args = parser.parse_args()
    for depth in args.depths:
        if depth < 1:
            parser.error(f"--depths: {depth} is not a queue depth (at least 1)")
    nbytes = int(args.file_gib * 2**30) // ALIGN * ALIGN
    if not args.dir.is_dir():
        parser.error(f"--dir {args.dir}: not a directory")
    free = shutil.disk_usage(args.dir).free
    if nbytes > free - 2**30:
        parser.error(f"--file-gib {args.file_gib}: only {free / 2**30:.1f} GiB free there")
    path = args.dir / "disk_read.bin"
    try:
        write_gbps = write_scratch(path, nbytes)
        print(f"wrote {nbytes / 2**30:.1f} GiB scratch at {write_gbps:.2f} GB/s: {path}")
        results = []
        for mib in args.expert_mib:
            record = aligned(int(mib * 2**20))
            for direct in (True, False):
                for depth in args.depths:
                    row = run(path, direct, depth, record, args.seconds, seed=depth)
                    results.append(row)
                    print(
                        f"{mib:5.2f} MiB {'direct ' if direct else 'cached '} depth "
                        f"{depth:2d}: {row['gbps']:.2f} GB/s, p50 "
                        f"{row['latency_ms_p50']:.1f} ms, p90 {row['latency_ms_p90']:.1f} ms",
                        flush=True,
                    )
        checked = []
        for mib in args.expert_mib:
            record = aligned(int(mib * 2**20))
            pair = [
                run(path, True, args.checksum_depth, record, args.seconds, 7, checked=c)
                for c in (False, True)
            ]
            plain, hashed = pair
            gb = hashed["reads"] * record / 1e9
            row = {
                "record_bytes": record,
                "depth": args.checksum_depth,
                "unchecked_gbps": plain["gbps"],
                "checked_gbps": hashed["gbps"],
                "checked_over_unchecked": hashed["gbps"] / plain["gbps"],
                "hash_core_seconds_per_gb": hashed["hash_seconds"] / gb,
                "hash_gbps_one_core": gb / hashed["hash_seconds"],
            }
            checked.append(row)
            print(
                f"{mib:5.2f} MiB direct depth {args.checksum_depth}: "
                f"{row['unchecked_gbps']:.2f} GB/s unchecked, {row['checked_gbps']:.2f} checked "
                f"({row['checked_over_unchecked']:.3f}x); xxh3 "
                f"{row['hash_core_seconds_per_gb'] * 1e3:.1f} ms of a core per GB read "
                f"({row['hash_gbps_one_core']:.1f} GB/s)",
                flush=True,
            )
    finally:
        path.unlink(missing_ok=True)
        print(f"removed {path}")
    out = RESULTS / f"{args.name}.json"
    command = command_line()
    out.write_text(
        json.dumps(
            {
                "command": command,
                "real_io": True,
                "file_bytes": nbytes,
                "write_gbps": write_gbps,
                "seconds_per_run": args.seconds,
                "results": results,
                "checksum": checked,
            },
            indent=1,
        )
    )
    plot(results, out.with_suffix(".png"), f"whole-expert random reads, real I/O: {command}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    print(f"command: {command}")


if __name__ == "__main__":
    main()
