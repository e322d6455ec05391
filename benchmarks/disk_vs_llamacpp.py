"""A model bigger than this machine's memory, side by side in one run: llama.cpp on a GGUF
(mmap, as its users run it, then with both cores), vanilla vLLM, and the plugin's disk
tier in several modes, at 1, 8 and 32 sequences. Real I/O; nothing modeled.

    python benchmarks/disk_vs_llamacpp.py [--work DIR] [--ram-ratio 1.25] [--host-ratio 0.5]
                                          [--batches 1 8 32] [--keep] [--name disk_vs_llamacpp]
                                          [--memory-limit-gb G]

``make bench-disk`` installs llama-cpp-python (built from source for this CPU) and gguf,
then runs this.

The model: the embedded model with its experts widened (``specexpert widen``) until the
checkpoint weighs ``--ram-ratio`` times this machine's RAM (MemTotal). Its routing is the
small trained model's; its bytes, reads and expert multiplies are a large model's.

The miniature (``--memory-limit-gb G``, ``make bench-disk-mini``): each phase runs in a
memory cgroup limited to G GB (:mod:`memory_cgroup`; root only, refused at once where no
cgroup can be made), and G GB stands for RAM wherever RAM sizes something: the model
(``--ram-ratio`` x G) and the host caches (``--host-ratio`` and the sweep's shares of G).
The same comparison on a model a few GB large, in minutes; page cache counts to a
cgroup's usage, as it fills RAM on the full-size run. Per phase, the JSON has the
cgroup's limit, peak, OOM kills and page cache at the end; a phase or engine the
cgroup's OOM killer ended is a row "killed for memory".

Each phase runs in its own process, one after the other, so that each starts from the
same memory and its peak RSS is its own:

1. ``reference``: vanilla vLLM's greedy tokens on the trained model (the check of the
   GGUF conversion, below).
2. ``llamacpp``: a GGUF of the trained model, whose greedy tokens are compared with
   vanilla's (the conversion is checked before it is measured); then the widened GGUF
   (written from the trained model, padded as ``widen`` pads), measured with
   llama-cpp-python's defaults and with ``n_threads=2``; then deleted (the disk cannot hold
   it beside the checkpoint and the pack).
3. ``vanilla``: the widened checkpoint written; vanilla vLLM started on it in a child with
   ``oom_score_adj`` 1000 (if the kernel must kill, it kills that child): what happens.
4. ``plugin``: the pack written (timed), one engine with ``disk`` and ``budget: "auto"``
   (as a user starts it), each mode by ``reconfigure`` (``auto`` again).
5. ``scheduler``: the token scheduler (groups of 8, the path predictor) in an engine of
   its own with ``budget: "auto"``, at the batches above 8.
6. ``sweep``: ``fetch`` + LRU started with ``budget: "auto"``, then at fixed host caches
   of 0.5, 0.4 and 0.3 of RAM (budgets fitted to the machine).
7. ``serve``: ``specexpert serve`` on the same model and pack, 1 then 32 concurrent
   completions; the server's RSS and its ``/metrics`` disk counters.

Per run: decode tok/s (decode steps only, each timed: llama.cpp's median step; the
plugin's engine stepped one step at a time in this process, the decode steps' tokens
over their seconds), the prefill's seconds, GB the process read from
storage per decode token (``/proc/<pid>/io`` ``read_bytes``: page faults and ``O_DIRECT``
alike), peak RSS, and the page cache's growth. The page cache is dropped before each
engine starts (``/proc/sys/vm/drop_caches``, when allowed; the JSON says whether it was).
Writes ``benchmarks/results/<name>.json``, ``.png``, and ``.md`` (the table for the docs);
removes what it wrote under ``--work`` unless ``--keep``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, command_line, kib, work_dir, write_outputs
from memory_cgroup import CgroupError, MemoryCgroup

HERE = Path(__file__).resolve()
PHASES = (
    "reference",
    "llamacpp",
    "vanilla",
    "plugin",
    "scheduler",
    "scheduler_grouping",
    "lookahead",
    "sweep",
    "mapped",
    "mapped_ahead",
    "approximate",
    "serve",
)
TOKENS = {1: 16, 8: 8, 16: 8, 32: 5, 64: 5, 128: 6, 256: 8}
"""Tokens generated per sequence at each batch (bigger batches read more per step)."""
PROMPT_TOKENS = 32

ARTIFACTS = {
    "calibration": "tiny-qwen3-moe-calibration",
    "estimator": "tiny-qwen3-moe-estimator",
    "path_predictor": "tiny-qwen3-moe-path-predictor",
}
"""The trained model's artifacts, carried to the widened model by ``widen``: read at
start (the modes below switch what uses them)."""

CEILING_MODE = "random substitute: nothing read, the same compute (compute ceiling)"
NO_ROWS_AHEAD = "fetch, LRFU, no rows kept for reads ahead"
"""``fetch`` with ``disk.read_ahead_rows`` 0 (what a split leaves by rounding only), beside
the default's rows kept for the following layer's reads while a launch computes."""
FETCH_AGAIN = "fetch, LRU, again at the end"
"""``fetch`` run first and last: the two bound the drift of the disk's rate over the
phase (in one miniature run, modes that read the same bytes ran 1.12-1.27x apart)."""
JUDGED = (
    "prefetch_judged_off",
    "ghost_loads_prefetching",
    "ghost_loads_not_prefetching",
    "calls_predicted",
    "calls_plain",
    "ghost_loads_predicted",
    "ghost_loads_plain",
)
"""The judge by bytes' counters (``planner.bytes_judge``), kept per row where they exist."""

MODES = {
    "fetch, LRU": {"miss_policy": "fetch", "cache": "lru", "predictor": "none"},
    "fetch, LRFU": {"miss_policy": "fetch", "cache": "lrfu", "predictor": "none"},
    "fetch, Markov": {"miss_policy": "fetch", "cache": "markov", "predictor": "none"},
    NO_ROWS_AHEAD: {
        "miss_policy": "fetch",
        "cache": "lrfu",
        "predictor": "none",
        "disk": {"read_ahead_rows": 0},
    },
    "fetch + router prefetch (cost filter)": {
        "miss_policy": "fetch",
        "cache": "lru",
        "predictor": "router",
        "prefetch_filter": "cost",
    },
    "fetch + quasi_hidden prefetch": {
        "miss_policy": "fetch",
        "cache": "lru",
        "predictor": "quasi_hidden",
    },
    "fetch + estimator prefetch": {
        "miss_policy": "fetch",
        "cache": "lru",
        "predictor": "estimator",
    },
    "fetch + estimator prefetch, ungoverned": {
        "miss_policy": "fetch",
        "cache": "lru",
        "predictor": "estimator",
        "prefetch_governor": False,
    },
    "stream, LRU": {
        "miss_policy": "stream",
        "cache": "lru",
        "predictor": "none",
    },
    "plec + path predictor": {
        "miss_policy": "fetch",
        "cache": "plec",
        "predictor": "none",
    },
    CEILING_MODE: {
        "miss_policy": "random",
        "cache": "lru",
        "predictor": "none",
        "buddy": {"tau": 0.0, "beta": 1.0, "rho": 64},
        "quality": None,  # (the ceiling: never switched to exact by the default budget)
    },
    FETCH_AGAIN: {"miss_policy": "fetch", "cache": "lru", "predictor": "none"},
    "fetch, LRFU, again at the end": {"miss_policy": "fetch", "cache": "lrfu", "predictor": "none"},
    "fetch, LRFU, 32 rows kept for reads ahead": {
        "miss_policy": "fetch",
        "cache": "lrfu",
        "predictor": "none",
        "disk": {"read_ahead_rows": 32},
    },
    f"{NO_ROWS_AHEAD}, again at the end": {
        "miss_policy": "fetch",
        "cache": "lrfu",
        "predictor": "none",
        "disk": {"read_ahead_rows": 0},
    },
}
"""The plugin phase's modes, in one engine by ``reconfigure``; the last two are no
technique: the compute ceiling, then ``fetch`` again (:data:`FETCH_AGAIN`). The ceiling:
every missed expert is replaced by a resident one (no gate, no limit), so a step reads
nothing and computes as many experts as ``fetch``'s (its output is not the model's). No
prediction makes an exact step faster. ``drop`` would read nothing too, but it also
computes only the resident experts: on the miniature it ran 3-30x ``fetch``, a ceiling
too high to measure a share of."""


# --- measuring a process -----------------------------------------------------------------


def read_bytes(pid: int | str = "self") -> int:
    """Bytes ``pid`` has caused to be read from storage (page faults and ``O_DIRECT``)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def memory(pid: int | str = "self") -> dict[str, float]:
    status = f"/proc/{pid}/status"
    return {
        "rss_gb": kib(status, "VmRSS") / 1e6,
        "rss_anon_gb": kib(status, "RssAnon") / 1e6,
        "rss_file_gb": kib(status, "RssFile") / 1e6,
        "peak_rss_gb": kib(status, "VmHWM") / 1e6,
    }


def mapped_rss_gb(path: Path, pid: int | str = "self") -> float:
    """Resident GB of ``pid``'s mappings of ``path`` (``/proc/<pid>/smaps``)."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and line.startswith("Rss:"):
            total += int(fields[1])
    return total / 1e6


def beyond_cache(stats: dict, pack: Path) -> dict[str, float]:
    """The process's resident memory now, split into its host cache and the rest: the
    cache is the slots (shared anonymous memory, ``RssShmem``) or, mapped, the pack's
    pages in the page cache (its mapping's resident pages); beyond it, the KV cache (the
    budget's KV floor: its size given) and what remains: vLLM, torch, the dense weights,
    compiled code, the passes' scratch held by the allocator, the read buffers and the
    libraries' pages (issue 48's target: at most 1.5 GB besides the KV cache). Measured
    after the C heap's free pages are given back to the OS (``heap_released_gb``: what
    the allocator held free then)."""
    from vllm_specexpert.tiers.expert_pack import RECORDS_FILE
    from vllm_specexpert.tiers.memory import release_free_heap

    status = "/proc/self/status"
    held = kib(status, "RssAnon")
    release_free_heap()  # (what the allocator held free is not the process's need)
    released = (held - kib(status, "RssAnon")) / 1e6
    mapped = stats["disk"].get("residency") == "mapped"
    cache = mapped_rss_gb(pack / RECORDS_FILE) if mapped else kib(status, "RssShmem") / 1e6
    rss = kib(status, "VmRSS") / 1e6
    kv = stats["budget"].get("kv_bytes", 0.0) / 1e9
    return {
        "cache_gb": cache,
        "beyond_cache_gb": rss - cache,
        "kv_cache_gb": kv,
        "beyond_cache_and_kv_gb": rss - cache - kv,
        "heap_released_gb": released,
    }


def drop_page_cache() -> bool:
    """Drop clean page-cache pages (root only); whether it was done."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        return False
    return True


CGROUP: MemoryCgroup | None = None
"""The memory cgroup this phase runs in (``--memory-limit-gb``), else ``None``."""


class Window:
    """What one timed run read and grew: ``read_bytes`` and ``Cached`` before and after,
    and in a memory cgroup, the cgroup's usage and page cache at the end."""

    def __enter__(self) -> Window:
        self.read0 = read_bytes()
        self.cached0 = kib("/proc/meminfo", "Cached")
        return self

    def __exit__(self, *exc) -> None:
        self.read = read_bytes() - self.read0
        self.cached = (kib("/proc/meminfo", "Cached") - self.cached0) * 1000
        self.cgroup = {}
        if CGROUP is not None:
            cache = CGROUP.page_cache_bytes()
            self.cgroup = {
                "cgroup_usage_gb_end": CGROUP.usage_bytes() / 1e9,
                "cgroup_page_cache_gb_end": None if cache is None else cache / 1e9,
            }


# --- the model and its prompts ---------------------------------------------------------


def prompt_ids(count: int, part: int = 0) -> list[list[int]]:
    """``count`` held-out prompts of ``PROMPT_TOKENS`` token ids each; ``part``: which
    ``PROMPT_TOKENS`` of each file (another part: other prompts, the same lengths)."""
    from vllm_specexpert.tools import corpus
    from vllm_specexpert.tools.embedded_model import load_tokenizer

    tokenizer = load_tokenizer()
    files = sorted(corpus.corpus_files("validation"), key=lambda f: -f.size)
    span = slice(part * PROMPT_TOKENS, (part + 1) * PROMPT_TOKENS)
    ids = [tokenizer.encode(f.read()).ids[span] for f in files]
    ids = [p for p in ids if len(p) == PROMPT_TOKENS]
    return [ids[i % len(ids)] for i in range(count)]


def ram_bytes(args) -> float:
    """What the model and the host caches are sized against: the cgroup limit
    (``--memory-limit-gb``) when there is one, else this machine's RAM (MemTotal)."""
    if args.memory_limit_gb is not None:
        return args.memory_limit_gb * 1e9
    return kib("/proc/meminfo", "MemTotal") * 1024


def intermediate_for(ram_ratio: float, ram: float) -> int:
    """The expert intermediate size whose widened checkpoint weighs ``ram_ratio`` x ``ram``
    bytes, a multiple of :data:`INT4_GROUP` (the ``lookahead`` draft's INT4 groups)."""
    from vllm_specexpert.tools.embedded_model import TRAINED_MODEL_DIR

    config = json.loads((TRAINED_MODEL_DIR / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    experts = config.get("num_experts") or config["num_local_experts"]
    target = ram_ratio * ram
    return round(target / (layers * experts * 3 * hidden * 2) / INT4_GROUP) * INT4_GROUP


INT4_GROUP = 128


def tokens_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=False)]
    return sum(x == y for x, y in pairs) / len(pairs)


# --- phases ----------------------------------------------------------------------------


def phase_reference(args, work: Path) -> dict:
    from vllm import SamplingParams

    from vllm_specexpert.tools.embedded_model import TRAINED_MODEL_DIR
    from vllm_specexpert.tools.harness import start_engine

    llm = start_engine(str(TRAINED_MODEL_DIR), None, eager=False, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(8)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs]}


def phase_llamacpp(args, work: Path) -> dict:
    from llamacpp import LlamaCppDecoder, write_gguf

    from vllm_specexpert.tools.embedded_model import TRAINED_MODEL_DIR

    reference = json.loads((work / "part-reference.json").read_text())["tokens"]
    small = work / "trained.gguf"
    write_gguf(TRAINED_MODEL_DIR, small)
    decoder = LlamaCppDecoder(small, n_ctx=2048, n_seq_max=8, n_threads=2)
    check = decoder.generate(prompt_ids(8), 16)["tokens"]
    decoder.close()
    small.unlink()
    result: dict = {"conversion_agreement_with_vanilla_vllm": tokens_agreement(check, reference)}
    print(
        f"llama.cpp on the trained model's GGUF: "
        f"{result['conversion_agreement_with_vanilla_vllm']:.3f} of greedy tokens equal "
        "to vanilla vLLM's",
        flush=True,
    )

    big = work / "model.gguf"
    started = time.perf_counter()
    result["gguf_bytes"] = write_gguf(TRAINED_MODEL_DIR, big, args.intermediate)
    result["gguf_write_s"] = time.perf_counter() - started
    print(
        f"wrote {big}: {result['gguf_bytes'] / 1e9:.1f} GB in {result['gguf_write_s']:.0f} s",
        flush=True,
    )
    batch_max = max(args.batches)
    runs = {}
    # llama-cpp-python's default is n_threads = cores // 2; llama-cli's, the physical
    # cores (here both, and the faster of the two).
    for setting, threads in (("mmap, n_threads=1", 1), ("mmap, n_threads=2", 2)):
        dropped = drop_page_cache()
        cached0 = kib("/proc/meminfo", "Cached")
        decoder = LlamaCppDecoder(
            big, n_ctx=batch_max * 128, n_seq_max=batch_max, n_threads=threads
        )
        rows: dict = {"n_threads": decoder.n_threads, "page_cache_dropped": dropped}
        for batch in args.batches:
            prompts = prompt_ids(batch)
            with Window() as window:
                out = decoder.generate(prompts, TOKENS[batch])
            steps = sorted(out["step_s"])
            step = steps[len(steps) // 2]
            decode_tokens = batch * (TOKENS[batch] - 1)
            rows[str(batch)] = {
                "decode_tok_s": batch / step,
                "decode_s_per_step": step,
                "prefill_s": out["prefill_s"],
                "gb_read_per_decode_token": out["decode_read_bytes"] / decode_tokens / 1e9,
                "gb_read_total": window.read / 1e9,
                **window.cgroup,
                **memory(),
            }
            print(
                f"llama.cpp {setting:18s} {batch:2d} seq: decode {batch / step:6.3f} tok/s, "
                f"prefill {out['prefill_s']:.1f} s, read {window.read / 1e9:.1f} GB",
                flush=True,
            )
        rows["page_cache_growth_gb"] = (kib("/proc/meminfo", "Cached") - cached0) / 1e6
        runs[setting] = rows
        decoder.close()
    big.unlink()
    result["runs"] = runs
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    return result


def phase_vanilla(args, work: Path) -> dict:
    model = widened(args, work)
    drop_page_cache()
    started, booted = time.perf_counter(), uptime_s()
    child = subprocess.Popen(
        [sys.executable, str(HERE), "--phase", "vanilla-child", "--work", str(work)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: Path("/proc/self/oom_score_adj").write_text("1000"),
    )
    peak, least_available = 0.0, float("inf")
    while child.poll() is None:
        with contextlib.suppress(OSError):  # (the child just exited)
            peak = max(peak, kib(f"/proc/{child.pid}/status", "VmRSS") / 1e6)
        least_available = min(least_available, kib("/proc/meminfo", "MemAvailable") / 1e6)
        time.sleep(0.5)
    tail = (child.stdout.read() if child.stdout else "").strip().splitlines()[-12:]
    code = child.returncode
    outcome = (
        f"killed by signal {-code}" if code < 0 else "generated" if code == 0 else f"exit {code}"
    )
    print(
        f"vanilla vLLM on {model.name}: {outcome} after "
        f"{time.perf_counter() - started:.0f} s, peak RSS {peak:.1f} GB",
        flush=True,
    )
    return {
        "outcome": outcome,
        "returncode": code,
        "seconds": time.perf_counter() - started,
        "peak_rss_gb_sampled": peak,
        "least_mem_available_gb": least_available,
        "output_tail": tail,
        "dmesg_oom": _oom_lines(booted),
    }


def uptime_s() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def _oom_lines(since_uptime_s: float) -> list[str]:
    """The kernel's last OOM lines logged after ``since_uptime_s`` (dmesg's clock)."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    lines = []
    for line in out.splitlines():
        stamp = line[1 : line.find("]")].strip() if line.startswith("[") else ""
        try:
            recent = float(stamp) >= since_uptime_s
        except ValueError:
            recent = False
        if recent and "oom" in line.lower():
            lines.append(line)
    return lines[-4:]


def vanilla_child(work: Path) -> None:
    from vllm import SamplingParams

    from vllm_specexpert.tools.harness import start_engine

    llm = start_engine(str(work / "model"), None, eager=False, max_model_len=512)
    out = llm.generate([{"prompt_token_ids": prompt_ids(1)[0]}], SamplingParams(max_tokens=4))
    print("generated", out[0].outputs[0].token_ids)


def widened(args, work: Path) -> Path:
    from vllm_specexpert.tools.embedded_model import (
        TRAINED_CALIBRATION_DIR,
        TRAINED_ESTIMATOR_DIR,
        TRAINED_MODEL_DIR,
        TRAINED_PATH_PREDICTOR_DIR,
    )
    from vllm_specexpert.tools.widen import carry_artifacts, widen_checkpoint

    model = work / "model"
    if not (model / "config.json").exists():
        widen_checkpoint(TRAINED_MODEL_DIR, model, intermediate=args.intermediate)
        carry_artifacts(
            TRAINED_MODEL_DIR,
            model,
            [TRAINED_CALIBRATION_DIR, TRAINED_ESTIMATOR_DIR, TRAINED_PATH_PREDICTOR_DIR],
        )
    return model


def host_cache(stats: dict) -> dict:
    """The slots per layer and their bytes in all, from an engine's stats."""
    slots = stats["slots_per_layer"]
    return {
        "slots_per_layer": next(iter(slots.values())),
        "gb": sum(stats["slot_bytes"][n] * count for n, count in slots.items()) / 1e9,
    }


def host_budget(args, work: Path, ratio: float | None = None) -> float:
    """The budget fraction whose slots weigh ``ratio`` (default ``--host-ratio``) of RAM
    (of the cgroup limit, if one is set)."""
    config = json.loads((work / "model" / "config.json").read_text())
    experts = config.get("num_experts") or config["num_local_experts"]
    expert = 3 * config["hidden_size"] * config["moe_intermediate_size"] * 2
    slots = int(
        (ratio or args.host_ratio) * ram_bytes(args) / (config["num_hidden_layers"] * expert)
    )
    return max(1, min(slots, experts)) / experts


def disk_engine(
    args,
    work: Path,
    budget: float | str,
    residency: str = "slots",
    engine: dict | None = None,
    **settings,
):
    """The plugin on the widened model and its pack, compiled, for up to the largest
    batch: ``budget`` and ``settings`` besides ``disk``; ``engine``: more ``LLM`` arguments."""
    from vllm_specexpert.tools.harness import start_engine

    # As a user starts it: no KV cache size given, the plugin sizes it for max_num_seqs
    # full-length sequences (common's 1 GiB default is for vanilla engines).
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    disk = {"path": str(work / "pack"), "residency": residency}
    config = {"budget": budget, "disk": disk, **settings}
    return start_engine(
        str(work / "model"),
        config,
        eager=False,
        max_model_len=512,
        max_num_seqs=max(args.batches),
        # Every prompt in one prefill step: the timed decode steps are decode only (in
        # chunks, the first requests decode, and finish, before the last ones prefill).
        max_num_batched_tokens=max(2048, max(args.batches) * PROMPT_TOKENS),
        **(engine or {}),
    )


def packed(args, work: Path) -> tuple[Path, float]:
    """The widened model and its pack (made now if absent, in this machine's kernel
    form): the model's directory and the seconds the pack took to write (0: made before)."""
    import torch

    from vllm_specexpert.layers.int4_copies import Int4DraftForm
    from vllm_specexpert.tiers.kernel_form import cpu_kernel_form
    from vllm_specexpert.tiers.pack_writer import pack_checkpoint

    model = widened(args, work)
    pack = work / "pack"
    started = time.perf_counter()
    if not (pack / "manifest.json").exists():  # (with the draft's regions: lookahead's)
        form = cpu_kernel_form(torch.bfloat16)
        pack_checkpoint(str(model), pack, form, "disk.path", "model", Int4DraftForm(torch.bfloat16))
    return model, time.perf_counter() - started


def phase_plugin(args, work: Path) -> dict:
    import vllm_specexpert
    from vllm_specexpert.config import SpecExpertConfigError

    model, pack_s = packed(args, work)
    pack = work / "pack"
    budget = "auto"  # as a user starts it: every mode in the memory this machine has
    dropped = drop_page_cache()
    cached0 = kib("/proc/meminfo", "Cached")
    started = time.perf_counter()
    llm = disk_engine(
        args, work, budget, **{k: str(model / "artifacts" / v) for k, v in ARTIFACTS.items()}
    )
    start_s = time.perf_counter() - started
    results: dict = {}
    budgets: dict = {}
    for mode in args.modes or MODES:  # (in the order given: the disk's rate drifts)
        try:
            # (disk settings a mode does not name go back to their defaults)
            change = {"disk": {"read_ahead_rows": "auto"}, **MODES[mode]}
            vllm_specexpert.reconfigure(llm, budget=budget, **change)
        except SpecExpertConfigError as error:  # (said at start, never mid-generation)
            results[mode] = {"refused": str(error)}
            print(f"plugin {mode}: refused: {error}", flush=True)
            continue
        budgets[mode] = host_cache(vllm_specexpert.get_stats(llm)[0])
        results[mode] = run_batches(llm, args.batches, f"plugin {mode:38s}")
        # Kept as it goes: a process the OOM killer ends keeps the modes it measured.
        (work / "part-plugin.json").write_text(
            json.dumps({"complete": False, "budget": budget, "modes": results}, indent=1)
        )
    stats = vllm_specexpert.get_stats(llm)[0]
    return {
        "pack_write_s": pack_s,
        "pack_bytes": sum(f.stat().st_size for f in pack.iterdir()),
        "budget": budget,
        "host_cache_per_mode": budgets,
        "summary": stats["summary"],
        "engine_start_s": start_s,
        "page_cache_dropped": dropped,
        "page_cache_growth_gb": (kib("/proc/meminfo", "Cached") - cached0) / 1e6,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "modes": results,
    }


SWEEP_RATIOS = (0.5, 0.4, 0.3)
"""Fixed host caches (shares of RAM) that ``budget: "auto"`` is compared with, largest
first (a ``reconfigure`` may keep or shrink what runs); 0.65 and 0.75 were killed out
of memory on this machine."""


def phase_sweep(args, work: Path) -> dict:
    """``fetch`` + LRU in an engine started with ``budget: "auto"`` (as a user starts
    it), then at fixed host caches of :data:`SWEEP_RATIOS` of RAM, each by
    ``reconfigure``."""
    import vllm_specexpert
    from vllm_specexpert.config import SpecExpertConfigError

    packed(args, work)
    drop_page_cache()
    llm = disk_engine(args, work, "auto")
    budgets = [(f"{r:g} x RAM", host_budget(args, work, r)) for r in args.sweep_ratios]
    results: dict = {}
    for label, budget in [("auto", None), *budgets]:
        if budget is not None:
            try:
                vllm_specexpert.reconfigure(llm, budget=budget)
            except SpecExpertConfigError as error:
                results[label] = {"refused": str(error)}
                continue
        stats = vllm_specexpert.get_stats(llm)[0]
        cache = host_cache(stats)
        rows = run_batches(llm, args.batches, f"sweep {label:10s} {cache['slots_per_layer']} slots")
        results[label] = {"host_cache": cache, "budget": stats["budget"], **rows}
        (work / "part-sweep.json").write_text(json.dumps({"complete": False, "runs": results}))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    return {"runs": results, "peak_rss_gb": peak}


SCHEDULER_MODES = {
    "scheduler": "fetch, LRU + token scheduler (groups of 8, governor)",
    "scheduler_grouping": "fetch, LRU + token scheduler (groups of 8, always grouping)",
}
LEARNING_TOKENS = 16
"""Tokens per sequence of an unmeasured run, on other prompts, before each measured run
of every mode: what a mode learns online (a measured switch's warm-up, a predictor's
precision) is learned there, as on a server that has run a while, where the measured
runs are a few steps long. It warms every mode's cache the same way, ``fetch``'s too."""


def phase_scheduler_grouping(args, work: Path) -> dict:
    return phase_scheduler(args, work, "scheduler_grouping")


def phase_lookahead(args, work: Path) -> dict:
    """MoE-SpeQ's draft on the disk tier: an engine of its own (the draft is built at
    start), its INT4 experts the pack's draft regions, read through its host rows and
    decoded into its slots; ``budget: "auto"`` leaves the draft its memory. The draft's
    routes are the verification pass's demand (``plec``, or ``--lookahead-cache``), the
    governor picks k."""
    import vllm_specexpert
    from vllm_specexpert.config import SpecExpertConfigError

    packed(args, work)
    drop_page_cache()
    mode = f"lookahead (governor) + {args.lookahead_cache}"
    started = time.perf_counter()
    try:
        llm = disk_engine(args, work, "auto", cache=args.lookahead_cache, lookahead={})
    except SpecExpertConfigError as error:  # (the draft does not fit: said at start)
        print(f"plugin {mode}: refused: {error}", flush=True)
        return {"refused": str(error), "modes": {}}
    start_s = time.perf_counter() - started
    stats = vllm_specexpert.get_stats(llm)[0]
    head: dict = {"budget": "auto", "summary": stats["summary"], "engine_start_s": start_s}

    def kept(rows: dict) -> None:  # (with the draft's counters: a killed run keeps them)
        draft = vllm_specexpert.get_stats(llm)[0]["lookahead"]
        part = {"complete": False, **head, "lookahead": draft, "modes": {mode: rows}}
        (work / "part-lookahead.json").write_text(json.dumps(part))

    rows = run_batches(llm, args.batches, f"plugin {mode}", kept)
    stats = vllm_specexpert.get_stats(llm)[0]
    return {
        **head,
        "host_cache": host_cache(stats),
        "lookahead": stats["lookahead"],
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "modes": {mode: rows},
    }


def phase_mapped(args, work: Path, settings: dict | None = None, name: str = "mapped") -> dict:
    """``fetch`` on the mapped pack (``disk.residency: "mapped"``): the kernel on the
    pack's pages, the page cache as the cache (the process's memory is what is not).
    ``settings``: more of the engine's config."""
    import vllm_specexpert

    packed(args, work)
    dropped = drop_page_cache()
    started = time.perf_counter()
    llm = disk_engine(args, work, "auto", residency="mapped", **(settings or {}))
    start_s = time.perf_counter() - started
    stats = vllm_specexpert.get_stats(llm)[0]
    head: dict = {"summary": stats["summary"], "engine_start_s": start_s}

    def kept(rows: dict) -> None:
        (work / f"part-{name}.json").write_text(json.dumps({"complete": False, **head, **rows}))

    rows = run_batches(llm, args.batches, name, kept)
    return {**head, **rows, "page_cache_dropped": dropped}


def phase_mapped_ahead(args, work: Path) -> dict:
    """:func:`phase_mapped` with the estimator's predictions read ahead as page hints
    (``MADV_WILLNEED``), in an engine of its own: the page cache the first engine
    filled is its own, which only a new process drops (mapped pages are not dropped)."""
    model = widened(args, work)
    artifacts = {k: str(model / "artifacts" / ARTIFACTS[k]) for k in ("calibration", "estimator")}
    return phase_mapped(args, work, {"predictor": "estimator", **artifacts}, "mapped_ahead")


def phase_scheduler(args, work: Path, phase: str = "scheduler") -> dict:
    """The token scheduler on the disk tier: an engine of its own (it replaces vLLM's
    scheduler class at start), the same host cache, at the batches above its group size
    (it holds requests back only when more than ``group_size`` decode). ``phase``: with
    its governor (``scheduler``), or grouping at every step (``scheduler_grouping``)."""
    import vllm_specexpert

    packed(args, work)
    budget = "auto"
    drop_page_cache()
    llm = disk_engine(
        args,
        work,
        budget,
        path_predictor=str(work / "model" / "artifacts" / ARTIFACTS["path_predictor"]),
        token_scheduler={"group_size": 8, "governor": phase == "scheduler"},
    )
    label = SCHEDULER_MODES[phase]
    rows = run_batches(llm, [b for b in args.batches if b > 8], f"plugin {label}")
    stats = vllm_specexpert.get_stats(llm)[0]
    return {
        "budget": budget,
        "summary": stats["summary"],
        "scheduler": stats["scheduler"],
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "modes": {label: rows},
    }


APPROXIMATE_MODES = {
    "buddy, quality 2 %": {"miss_policy": "buddy", "predictor": "none"},
    "speculate quasi_hidden, quality 2 %": {
        "miss_policy": "speculate",
        "predictor": "quasi_hidden",
    },
}
"""The approximate modes that avoid reads, each under the default quality budget
(``quality: {}``: at most 2 % of next-token accuracy lost, as the engine estimates it),
with ``fetch`` first as their reference."""
ACCURACY_WINDOWS = 128
"""Held-out windows per mode for its accuracy (16 prompt tokens and 32 forced, as the
batched accuracy benchmark's: 4096 positions, so that a 2 % loss can be told from 2.3 %),
decoded the largest batch at a time."""


def phase_approximate(args, work: Path) -> dict:
    """The approximate modes on the disk (:data:`APPROXIMATE_MODES`), in an engine started
    with ``budget: "auto"`` and the quality budget, each by ``reconfigure``: decode speed
    at each batch as ``plugin`` measures it, then next-token accuracy on held-out code
    (teacher-forced, :data:`ACCURACY_WINDOWS` windows, the largest batch at a time)
    beside ``fetch``'s in the same engine, and what the quality budget made of it."""
    from batched_accuracy import FORCED_TOKENS, PROMPT_TOKENS
    from miss_policies import DEFAULT_BUDDY

    import vllm_specexpert
    from vllm_specexpert.tools.teacher_forcing import (
        TeacherForcing,
        held_out_windows,
        teacher_forced,
    )

    model, _ = packed(args, work)
    drop_page_cache()
    artifacts = {k: str(model / "artifacts" / v) for k, v in ARTIFACTS.items()}
    llm = disk_engine(
        args,
        work,
        "auto",
        engine={"logits_processors": [TeacherForcing]},
        quality={},  # (started in a mode it applies to: an exact one refuses it)
        miss_policy="buddy",
        buddy=DEFAULT_BUDDY,
        **artifacts,
    )
    windows = held_out_windows(ACCURACY_WINDOWS, PROMPT_TOKENS + FORCED_TOKENS, "test")
    actual = [t for w in windows for t in w[PROMPT_TOKENS:]]
    modes = {"fetch (exact)": {"miss_policy": "fetch", "predictor": "none"}, **APPROXIMATE_MODES}
    results: dict = {}
    exact: dict | None = None
    for label, mode in modes.items():
        buddy = {"buddy": DEFAULT_BUDDY} if mode["miss_policy"] == "buddy" else {}
        quality = None if mode["miss_policy"] == "fetch" else {}
        vllm_specexpert.reconfigure(llm, budget="auto", **mode, **buddy, quality=quality)
        rows = run_batches(llm, args.batches, f"approximate {label:36s}")
        vllm_specexpert.reset_stats(llm)
        forced = teacher_forced(llm, windows, PROMPT_TOKENS, batch=max(args.batches))
        stats = vllm_specexpert.get_stats(llm)[0]
        exact = exact or forced
        n = len(actual)
        accuracy = sum(a == b for a, b in zip(forced["top1"], actual, strict=True)) / n
        exact_accuracy = sum(a == b for a, b in zip(exact["top1"], actual, strict=True)) / n
        rows["accuracy"] = {
            "positions": n,
            "accuracy": accuracy,
            "kept": accuracy / exact_accuracy,
            "top1_equal_exact": sum(
                a == b for a, b in zip(forced["top1"], exact["top1"], strict=True)
            )
            / n,
            "output": stats["output"],
            "quality": stats.get("quality"),
        }
        print(f"approximate {label}: accuracy {accuracy:.4f} ({rows['accuracy']})", flush=True)
        results[label] = rows
        (work / "part-approximate.json").write_text(
            json.dumps({"complete": False, "modes": results}, default=str)
        )
    return {
        "windows": ACCURACY_WINDOWS,
        "forced_tokens": FORCED_TOKENS,
        "modes": results,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
    }


class RouteRecorder:
    """The engine's calls, recorded in this process (the engine core runs in it): per
    layer, the experts each call needs and whether it decodes; replayed by
    :mod:`clairvoyant` at the engine's slots per layer."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[np.ndarray, bool]]] = {}
        self.read_once: dict[str, int] = {}
        """Per layer, the read-once bound of its decode calls: the distinct experts each
        needed that were not resident at its start (bytes no order of reads can beat
        without keeping other experts)."""
        self.initial: dict[str, list[int]] = {}
        """Per layer, its resident experts when its first call with decode tokens came,
        least recently used first: where the replays start. The prompts' passes before
        it are not replayed: a clairvoyant replay through them would keep just what the
        decode needs and count none of it to the decode (MIN read 0.017 GB per decode
        token at 8 sequences in 48e, 9.6x under fetch, on 7 decode steps)."""
        self.order: list[tuple[str, np.ndarray, bool]] = []
        """Every layer's recorded calls in the order they ran: the pooled replay's."""
        self.on = False
        self.installed = False

    @contextlib.contextmanager
    def recording(self):
        if not self.installed:
            self._install()
        self.calls, self.initial, self.read_once, self.on = {}, {}, {}, True
        self.order = []
        try:
            yield
        finally:
            self.on = False

    def _install(self) -> None:
        from vllm_specexpert.engine import OffloadEngine

        original = OffloadEngine.run_call
        recorder = self

        def run_call(engine, request):
            decodes = request.phases is None or not request.phases.all_prefill
            equipped = engine.layers[request.layer].equipped  # (a deferred draft's: not)
            if recorder.on and equipped and (decodes or request.layer in recorder.initial):
                # A copy: on the CPU the ids are a view of vLLM's buffer, which the next
                # pass writes over (kept as a view, every recorded call became a later one).
                ids, phases = request.topk_ids.cpu().numpy().copy(), request.phases
                if request.layer not in recorder.initial:
                    cache = engine.layers[request.layer].cache
                    resident = np.flatnonzero(cache.expert_slot >= 0)
                    order = np.argsort(cache.policy.last_used[resident], kind="stable")
                    recorder.initial[request.layer] = resident[order].tolist()
                calls = recorder.calls.setdefault(request.layer, [])
                made = len(calls)
                if phases is None or phases.all_decode or phases.all_prefill:
                    calls.append((ids, phases is None or phases.all_decode))
                    decoding = ids if calls[-1][1] else ids[:0]
                else:  # the engine runs a mixed pass's decode rows first
                    decoding = ids[phases.decode]
                    calls.append((decoding, True))
                    calls.append((ids[phases.prefill], False))
                recorder.order += [(request.layer, *call) for call in calls[made:]]
                slot = engine.layers[request.layer].cache.expert_slot
                missing = int(np.count_nonzero(slot[np.unique(decoding)] < 0))
                once = recorder.read_once
                once[request.layer] = once.get(request.layer, 0) + missing
            return original(engine, request)

        OffloadEngine.run_call = run_call  # type: ignore[method-assign]
        self.installed = True

    def bounds(self, stats: dict, decode_tokens: int) -> dict:
        """GB per decode token that Belady's MIN and LRU would read on the recorded
        calls (from the first with decode tokens) at the engine's slots per layer, each
        layer's cache starting with what the engine's held then (a replay from empty
        would count loads the engine never needed); and MIN and LRU of one cache of all
        layers' slots and the shared region's rows together, over every layer's calls in
        the order they ran (what the budget's memory holds, however it is split)."""
        from clairvoyant import belady_misses, flatten, flatten_pooled, lru_misses

        best = lru = once = 0
        for name, calls in self.calls.items():
            if name not in stats["slots_per_layer"]:
                continue  # (the lookahead draft's layers: its engine's, not the target's)
            sequence, decode = flatten(calls)
            slots = stats["slots_per_layer"][name]
            expert = stats["expert_bytes"][name]
            initial = self.initial.get(name, [])[-slots:]
            best += belady_misses(sequence, decode, slots, initial) * expert
            lru += lru_misses(sequence, decode, slots, initial) * expert
            once += self.read_once.get(name, 0) * expert
        return {
            "clairvoyant_gb_per_decode_token": best / decode_tokens / 1e9,
            "lru_replayed_gb_per_decode_token": lru / decode_tokens / 1e9,
            "read_once_gb_per_decode_token": once / decode_tokens / 1e9,
            **self._pooled(stats, decode_tokens, belady_misses, lru_misses, flatten_pooled),
        }

    def _pooled(self, stats: dict, decode_tokens: int, belady, lru, flatten_pooled) -> dict:
        """:meth:`bounds`' pooled replays (module :mod:`clairvoyant`'s functions passed
        in: imported where the benchmark's directory is on the path)."""
        layers = [name for name in stats["slots_per_layer"] if name in self.calls]
        if not layers:
            return {}
        index = {name: i for i, name in enumerate(layers)}
        width = max(stats["experts_per_layer"][n] for n in layers)
        calls = [(index[n], ids, d) for n, ids, d in self.order if n in index]
        sequence, decode = flatten_pooled(calls, width)
        expert = [stats["expert_bytes"][n] for n in layers]
        pairs = zip(sequence, decode, strict=True)
        counted = [expert[pair // width] if d else 0.0 for pair, d in pairs]
        rows = max(stats.get("region_rows_per_layer", {}).values(), default=0)  # (one region)
        capacity = sum(stats["slots_per_layer"][n] for n in layers) + rows
        initial = [
            index[n] * width + e
            for n in layers
            for e in self.initial.get(n, [])[-stats["slots_per_layer"][n] :]
        ]
        # The read-once bound: a decode call reads what it needs beyond a layer's
        # share of every slot and row, as if all of those held experts it needs.
        share = capacity / len(layers)
        once = sum(
            max(0.0, len(np.unique(ids)) - share) * expert[index[n]]
            for n, ids, d in self.order
            if d and n in index
        )
        return {
            "pooled_capacity": capacity,
            "read_once_pooled_gb_per_decode_token": once / decode_tokens / 1e9,
            "clairvoyant_pooled_gb_per_decode_token": belady(sequence, counted, capacity, initial)
            / decode_tokens
            / 1e9,
            "lru_pooled_gb_per_decode_token": lru(sequence, counted, capacity, initial)
            / decode_tokens
            / 1e9,
        }


ROUTES = RouteRecorder()


def run_batches(
    llm, batches: list[int], label: str, kept: Callable[[dict], None] | None = None
) -> dict[str, dict]:
    """:func:`plugin_run` at each of ``batches`` (by batch, as a string), a line printed
    for each; ``kept(rows)`` after each (a phase's part file: what a process the OOM
    killer ends measured stays)."""
    rows: dict[str, dict] = {}
    for batch in batches:
        rows[str(batch)] = row = plugin_run(llm, batch)
        print(
            f"{label} {batch:2d} seq: decode {row['decode_tok_s']:6.3f} tok/s, "
            f"{row['gb_read_per_decode_token']:.3f} GB/token, hit {row['hit_rate']:.2f}, "
            f"disk {row['disk_gbps_while_waited']:.2f} GB/s while waited, "
            f"{row['os_read_gb_full_run']:.2f} GB read by the OS in the run",
            flush=True,
        )
        if kept is not None:
            kept(rows)
    return rows


def plugin_run(llm, batch: int) -> dict:
    from common import stepped_generate, timed_generate

    import vllm_specexpert

    prompts = [{"prompt_token_ids": p} for p in prompt_ids(batch)]
    tokens = TOKENS[batch]
    timed_generate(llm, prompts[:1], 2)  # warm after the rebuild
    learning = [{"prompt_token_ids": p} for p in prompt_ids(batch, part=1)]
    timed_generate(llm, learning, LEARNING_TOKENS)
    vllm_specexpert.reset_stats(llm)
    at_decode: dict = {}

    def decode_starts() -> None:  # (the scheduler's and the draft's work in the prefill)
        at_start = vllm_specexpert.get_stats(llm)[0]
        at_decode.update(work_s(at_start), disk_busy=at_start["disk"].get("busy_s", 0.0))

    with Window() as window, ROUTES.recording():
        first, steps = stepped_generate(llm, prompts, tokens, decode_starts)
    stats = vllm_specexpert.get_stats(llm)[0]
    decode_work = {key: end - at_decode.get(key, 0.0) for key, end in work_s(stats).items()}
    scheduler_s, draft_s = decode_work["scheduler"], decode_work["draft"]
    # Per token made: a scheduler that holds requests back makes fewer than ``batch``.
    decode_s, made = sum(s for s, _ in steps), sum(n for _, n in steps)
    d, n = stats["total"]["decode"], max(stats["decode_tokens"], 1)
    return {
        **ROUTES.bounds(stats, n),
        "decode_tok_s": made / decode_s if decode_s > 0 else float("nan"),
        "decode_s": decode_s,
        "decode_steps": [{"s": s, "tokens": n} for s, n in steps],
        "prefill_s": first,
        "hit_rate": d["hit_rate"],
        # (mapped: the kernel's pages are not loads; the OS's figures below count them)
        "gb_read_per_decode_token": d["bytes_loaded"] / n / 1e9,
        "stall_s_per_decode_token": d["stall_s"] / n,
        "breakdown_s_per_decode_token": breakdown(stats, decode_s, made, scheduler_s, draft_s),
        "prefetched_per_decode_token": d["prefetched"] / n,
        "prefetch_used_per_decode_token": d["prefetch_used"] / n,
        # (the judge by bytes, where it runs: its counts over this run's decode calls)
        "judged_by_bytes": {key: d[key] for key in JUDGED if key in d},
        **checks(stats["disk"], first + decode_s),
        "disk_gbps_while_waited": stats["disk"].get("waited_gbps", float("nan")),
        "disk_gbps_while_reading": stats["disk"].get("busy_gbps", float("nan")),
        # (slots: the reader's time with a read in flight over the decode steps' time)
        "disk_busy_share_of_decode": (
            (stats["disk"]["busy_s"] - at_decode["disk_busy"]) / decode_s
            if "busy_s" in stats["disk"] and decode_s > 0
            else float("nan")
        ),
        "os_read_gb_full_run": window.read / 1e9,
        "page_cache_growth_gb_full_run": window.cached / 1e9,
        **window.cgroup,
        "disk": stats["disk"],
        # (the shared region's rows kept for reads ahead, and what a launch's compute hid)
        "read_ahead_rows": stats.get("read_ahead_rows"),
        **memory(),
        "memory_now": beyond_cache(stats, Path(stats["disk"]["path"])),
    }


def work_s(stats: dict) -> dict[str, float]:
    """The token scheduler's and the draft's seconds so far (0 without them)."""
    return {
        "scheduler": (stats.get("scheduler") or {}).get("cpu_s", 0.0),
        "draft": (stats.get("lookahead") or {}).get("draft_s", 0.0),
    }


def breakdown(stats: dict, decode_s: float, made: int, scheduler_s: float, draft_s: float) -> dict:
    """The decode steps' seconds per generated token, measured: the expert kernel on
    resident experts, the wait for reads (the disk's, a mapped pack's pages), the wait
    for the host and peers, the engine's own work in the MoE layers' calls (their time
    less the kernel's and the waits'), the draft's rounds, the token scheduler's own
    work, and the rest of the step (attention, the dense layers, sampling, vLLM's
    bookkeeping). Per layer call counters include a step's prompt rows when it mixes
    them (the benchmark's decode steps do not)."""
    d = stats["total"]["decode"]
    waits = d.get("host_stall_s", 0.0) + d.get("peer_wait_s", 0.0)  # (places, when on)
    parts = {
        "kernel": d["kernel_s"],
        "read_wait": d["stall_s"],
        "host_and_peer_wait": waits,
        "engine": d["call_s"] - d["kernel_s"] - d["stall_s"] - waits,
        "draft": draft_s,
        "scheduler": scheduler_s,
        "rest_of_step": decode_s - d["call_s"] - draft_s - scheduler_s,
    }
    return {key: value / max(made, 1) for key, value in parts.items()}


def checks(disk: dict, run_s: float) -> dict:
    """The mapped residency's checksum checks in a run (prefill and decode): experts
    checked, seconds, and their share of the run's time (slots: checked on the reader's
    threads, within the reads' wait; not broken out)."""
    if "check_s" not in disk:
        return {}
    return {
        "checked_experts": disk["checked"],
        "check_s": disk["check_s"],
        "check_share_of_run": disk["check_s"] / run_s if run_s > 0 else float("nan"),
    }


def phase_serve(args, work: Path) -> dict:
    """``specexpert serve`` on the model and pack: 1 then 32 concurrent completions, the
    largest process's RSS sampled throughout, and ``/metrics``: the disk's counters, the
    hits and misses, and the slots (the host cache's bytes, against its budget)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import psutil
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    from vllm_specexpert.tools.server import free_port, serving

    model, pack = work / "model", work / "pack"
    config_json = json.loads((model / "config.json").read_text())
    expert_bytes = 3 * config_json["hidden_size"] * config_json["moe_intermediate_size"] * 2
    budget = host_budget(args, work)
    port = free_port()
    log = work / "serve.log"
    config = {"budget": budget, "disk": {"path": str(pack), "residency": "slots"}}
    result: dict = {"budget": budget, "log": str(log)}
    peak = {"rss_gb": 0.0}
    done_sampling = threading.Event()

    def sample(root: psutil.Process) -> None:
        while not done_sampling.wait(0.5):
            with contextlib.suppress(psutil.Error):
                processes = [root, *root.children(recursive=True)]
                rss = max(p.memory_info().rss for p in processes) / 1e9
                peak["rss_gb"] = max(peak["rss_gb"], rss)

    started = time.perf_counter()
    with serving(
        model,
        port,
        log,
        config,
        ["--max-model-len", "512", "--max-num-seqs", "32"],
        timeout_s=1800,
    ) as server:
        result["start_s"] = time.perf_counter() - started
        sampler = threading.Thread(target=sample, args=(psutil.Process(server.pid),))
        sampler.start()
        url = f"http://127.0.0.1:{port}"

        def complete(ids: list[int]) -> int:
            body = {
                "model": str(model),
                "prompt": ids,
                "max_tokens": 4,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            reply = requests.post(f"{url}/v1/completions", json=body, timeout=1800)
            reply.raise_for_status()
            return reply.json()["usage"]["completion_tokens"]

        try:
            for batch in (1, 32):
                begun = time.perf_counter()
                with ThreadPoolExecutor(batch) as pool:
                    done = list(pool.map(complete, prompt_ids(batch)))
                result[str(batch)] = {
                    "completions": len(done),
                    "tokens": sum(done),
                    "seconds": time.perf_counter() - begun,
                }
                print(f"serve {batch:2d} concurrent: {result[str(batch)]}", flush=True)
            text = requests.get(f"{url}/metrics", timeout=30).text
        finally:
            done_sampling.set()
            sampler.join()
    metrics: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample_ in family.samples:
            name = sample_.name
            if name.startswith("specexpert_disk") or name in (
                "specexpert_hits_total",
                "specexpert_misses_total",
                "specexpert_slots",
            ):
                metrics[name] = metrics.get(name, 0.0) + sample_.value
    layers = config_json["num_hidden_layers"]
    experts = config_json.get("num_experts") or config_json["num_local_experts"]
    result["metrics"] = metrics
    result["host_cache_gb"] = metrics.get("specexpert_slots", 0.0) * expert_bytes / 1e9
    result["host_budget_gb"] = budget * experts * layers * expert_bytes / 1e9
    result["largest_process_peak_rss_gb_sampled"] = peak["rss_gb"]
    print(f"serve: {result}", flush=True)
    return result


# --- the run ----------------------------------------------------------------------------


def run_phase(phase: str, args, work: Path) -> dict:
    """One phase in its own process (with ``--memory-limit-gb``, in a memory cgroup of its
    own, removed after). A phase that dies (the OOM killer) is a result: what it kept of
    its part file, and how it ended; the next phase still runs."""
    command = [
        sys.executable,
        str(HERE),
        "--phase",
        phase,
        "--work",
        str(work),
        "--intermediate",
        str(args.intermediate),
        "--host-ratio",
        str(args.host_ratio),
        "--sweep-ratios",
        *map(str, args.sweep_ratios),
        "--batches",
        *map(str, args.batches),
        *(["--modes", *args.modes] if args.modes else []),
        "--lookahead-cache",
        args.lookahead_cache,
    ]
    cgroup = None
    if args.memory_limit_gb is not None:
        cgroup = MemoryCgroup.create(
            round(args.memory_limit_gb * 1e9), f"specexpert-{phase}-{os.getpid()}"
        )
        command += ["--memory-limit-gb", str(args.memory_limit_gb), "--cgroup", str(cgroup.path)]
    print(f"--- {phase}", flush=True)
    part = work / f"part-{phase}.json"
    part.unlink(missing_ok=True)
    started, booted = time.time(), uptime_s()
    figures: dict = {}
    try:
        # The child enters the cgroup between fork and exec: all it allocates is charged.
        ended = subprocess.run(command, preexec_fn=None if cgroup is None else cgroup.enter)
        if cgroup is not None:
            figures = cgroup.figures()
    finally:
        if cgroup is not None:
            cgroup.remove()
    result = json.loads(part.read_text()) if part.exists() else {}
    kills = figures.get("oom_kills")
    if figures:
        result["memory_cgroup"] = figures
        print(f"--- {phase} memory cgroup: {figures}", flush=True)
    code = ended.returncode
    if code != 0:
        result["died"] = {
            "cause": "killed for memory" if kills else ending(code),
            "returncode": code,
            "after_s": time.time() - started,
            "dmesg_oom": _oom_lines(booted),
        }
        print(f"--- {phase} died: {result['died']}", flush=True)
    elif kills and str(result.get("outcome", "")).startswith("killed by signal"):
        # vanilla's engine runs in a child of its phase: the cgroup's OOM killer ended it.
        result["outcome"] = "killed for memory"
    return result


def ending(returncode: int) -> str:
    return f"killed by signal {-returncode}" if returncode < 0 else f"exit {returncode}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="(default: the cache's directory of --name)")
    parser.add_argument("--ram-ratio", type=float, default=1.25)
    parser.add_argument("--host-ratio", type=float, default=0.5)
    parser.add_argument("--intermediate", type=int, default=None, help="(instead of --ram-ratio)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument(
        "--sweep-ratios",
        type=float,
        nargs="*",
        default=list(SWEEP_RATIOS),
        help="fixed host caches (shares of RAM) the sweep compares with auto",
    )
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--keep", action="store_true", help="keep the model and pack")
    parser.add_argument(
        "--modes", nargs="+", choices=list(MODES), help="run in this order (default: all)"
    )
    parser.add_argument("--name", default="disk_vs_llamacpp")
    parser.add_argument(
        "--lookahead-cache",
        default="plec",
        choices=["plec", "lrfu", "lru"],
        help="the lookahead phase's cache (plec: the draft's routes are its demand)",
    )
    parser.add_argument(
        "--memory-limit-gb",
        type=float,
        help="run each phase in a memory cgroup of this many GB, sized as RAM (root only)",
    )
    parser.add_argument("--cgroup", help=argparse.SUPPRESS)
    parser.add_argument("--report", action="store_true", help="print an earlier run's tables")
    args = parser.parse_args()
    if args.report:
        report(args.name)
        return
    # Each name its own directory: the miniature does not reuse the full run's kept model.
    work = args.work or work_dir(args.name.replace("_", "-"))
    if args.phase:
        global CGROUP
        CGROUP = MemoryCgroup.open(args.cgroup) if args.cgroup else None
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if args.phase == "vanilla-child":
            vanilla_child(work)
            return
        result = globals()[f"phase_{args.phase}"](args, work)
        (work / f"part-{args.phase}.json").write_text(json.dumps(result, indent=1))
        return
    if args.memory_limit_gb is not None:
        try:  # refused now, not an hour in: a run without the limit is not the miniature
            probe = f"specexpert-probe-{os.getpid()}"
            MemoryCgroup.create(round(args.memory_limit_gb * 1e9), probe).remove()
        except CgroupError as error:
            sys.exit(f"--memory-limit-gb {args.memory_limit_gb:g}: no memory cgroup: {error}")
    sized_by_ratio = args.intermediate is None
    if sized_by_ratio:
        args.intermediate = intermediate_for(args.ram_ratio, ram_bytes(args))
    work.mkdir(parents=True, exist_ok=True)
    command = command_line()
    parts = {phase: run_phase(phase, args, work) for phase in args.phases}
    for phase in PHASES:  # a rerun of some phases keeps the others' results
        earlier = work / f"part-{phase}.json"
        if phase not in parts and earlier.exists():
            parts[phase] = {**json.loads(earlier.read_text()), "from_an_earlier_run": True}
    parts = {phase: parts[phase] for phase in PHASES if phase in parts}
    payload = {
        "real_io": True,
        "modeled": None,
        "intermediate": args.intermediate,
        "expert_mib": 3 * 256 * args.intermediate * 2 / 2**20,
        "ram_gb": kib("/proc/meminfo", "MemTotal") / 1e6,
        "memory_limit_gb": args.memory_limit_gb,
        "ram_ratio": args.ram_ratio if sized_by_ratio else None,
        "host_ratio": args.host_ratio,
        "batches": args.batches,
        "tokens_per_batch": TOKENS,
        **parts,
    }
    payload["headroom"] = headroom(payload)
    out = write_outputs(args.name, payload, markdown(payload, command), plot)
    if not args.keep:
        shutil.rmtree(work / "model", ignore_errors=True)
        shutil.rmtree(work / "pack", ignore_errors=True)
        print(f"removed {work / 'model'} and {work / 'pack'} (--keep keeps them)")
    print(f"wrote {out}")
    print(f"command: {command}")


MEMORY_PARTS = ("cache_gb", "beyond_cache_gb", "kv_cache_gb", "beyond_cache_and_kv_gb")


def plugin_modes(payload: dict) -> dict:
    """The plugin's modes: the plugin phase's and the scheduler phase's, then as a user
    starts it (``budget: "auto"``) in each residency: the sweep's first run (slots) and
    the mapped phase's."""
    auto = payload.get("sweep", {}).get("runs", {}).get("auto")
    mapped, ahead = payload.get("mapped"), payload.get("mapped_ahead")
    return {
        **payload.get("plugin", {}).get("modes", {}),
        **payload.get("scheduler", {}).get("modes", {}),
        **payload.get("scheduler_grouping", {}).get("modes", {}),
        **payload.get("lookahead", {}).get("modes", {}),
        **{
            m: rows
            for m, rows in payload.get("approximate", {}).get("modes", {}).items()
            if m in APPROXIMATE_MODES
        },
        **({"fetch, auto, slots residency": auto} if auto else {}),
        **({"fetch, mapped residency": mapped} if mapped else {}),
        **({"fetch + estimator read-ahead, mapped residency": ahead} if ahead else {}),
    }


def headroom(payload: dict) -> dict[str, dict]:
    """Per batch: ``fetch``'s seconds per decode token, the compute ceiling's
    (:data:`CEILING_MODE`), the disk bound (``fetch``'s bytes per token at the fastest
    rate the disk delivered while reading in this run), the overlap bound (``fetch``'s
    step with its reads' wait wholly hidden behind the rest of the step, or the rest
    behind the reads: all a prefetch of the same bytes can give), the MIN bound (Belady's
    bytes at that rate: all a better choice of what to keep can give), and each mode's
    share of the headroom between ``fetch`` and the ceiling (negative: slower)."""
    plugin = plugin_modes(payload)
    fetch, ceiling = plugin.get("fetch, LRU", {}), plugin.get(CEILING_MODE, {})
    rates = [
        run["disk_gbps_while_reading"]
        for runs in plugin.values()
        for run in runs.values()
        if isinstance(run, dict) and run.get("disk_gbps_while_reading", 0) > 0
    ]
    disk_gbps = max(rates, default=None)
    result: dict[str, dict] = {}
    for batch in map(str, payload["batches"]):
        if batch not in fetch or batch not in ceiling:
            continue
        fetch_s = 1 / fetch[batch]["decode_tok_s"]
        room = fetch_s - 1 / ceiling[batch]["decode_tok_s"]
        read = fetch[batch].get("breakdown_s_per_decode_token", {}).get("read_wait")
        belady = fetch[batch].get("clairvoyant_gb_per_decode_token")
        result[batch] = {
            "overlap_bound_s_per_token": None if read is None else max(read, fetch_s - read),
            "min_bound_s_per_token": belady / disk_gbps if disk_gbps and belady else None,
            "fetch_s_per_token": fetch_s,
            "ceiling_s_per_token": fetch_s - room,
            "headroom_share_of_fetch": room / fetch_s,
            "disk_gbps": disk_gbps,
            "disk_bound_s_per_token": (
                fetch[batch]["gb_read_per_decode_token"] / disk_gbps if disk_gbps else None
            ),
            "share_of_headroom": {
                mode: (fetch_s - 1 / runs[batch]["decode_tok_s"]) / room if room > 0 else None
                for mode, runs in plugin.items()
                if mode not in ("fetch, LRU", CEILING_MODE)
                and runs.get(batch, {}).get("decode_tok_s")
            },
        }
    return result


def headroom_table(payload: dict) -> list[str]:
    rooms = headroom(payload)
    if not rooms:
        return []
    batches = list(rooms)

    def row(name: str, cells: list[str]) -> str:
        return f"| {name} | " + " | ".join(cells) + " |"

    def seconds(key: str) -> list[str]:
        return ["-" if rooms[b][key] is None else f"{rooms[b][key]:.3f}" for b in batches]

    def share(mode: str) -> list[str]:
        values = [rooms[b]["share_of_headroom"].get(mode) for b in batches]
        return ["-" if v is None else f"{100 * v:.0f} %" for v in values]

    modes = dict.fromkeys(m for b in batches for m in rooms[b]["share_of_headroom"])
    return [
        "The headroom: seconds per decode token of `fetch` and of the compute ceiling "
        "(every miss replaced by a resident expert: nothing read, the same compute), "
        "`fetch`'s disk bound (its bytes per token at the fastest rate the disk gave in "
        "this run), the most a prefetch of the same bytes can give (`fetch` with its "
        "reads wholly overlapped with the rest of its step), the most a better choice of "
        "what to keep can give (Belady's MIN bytes at the disk's rate), and each mode's "
        "share of "
        "the headroom between `fetch` and the ceiling (negative: slower than `fetch`):",
        "",
        row("", [f"{b} seq" for b in batches]),
        "|---|" + "---|" * len(batches),
        row("fetch, s/token", seconds("fetch_s_per_token")),
        row("compute ceiling, s/token", seconds("ceiling_s_per_token")),
        row(
            "headroom, share of fetch's time",
            [f"{100 * rooms[b]['headroom_share_of_fetch']:.0f} %" for b in batches],
        ),
        row("fetch's disk bound, s/token", seconds("disk_bound_s_per_token")),
        row("fetch's reads wholly overlapped, s/token", seconds("overlap_bound_s_per_token")),
        row("Belady's MIN bytes at the disk's rate, s/token", seconds("min_bound_s_per_token")),
        *(row(f"{mode}: share of the headroom", share(mode)) for mode in modes),
        "",
    ]


BREAKDOWN_PARTS = (
    "kernel",
    "read_wait",
    "host_and_peer_wait",
    "engine",
    "draft",
    "scheduler",
    "rest_of_step",
)


def breakdown_table(payload: dict) -> list[str]:
    """Each mode's decode step per generated token, measured (:func:`breakdown`), at
    each batch."""
    rows = [
        f"| {mode} | {batch} | "
        + " | ".join(f"{1e3 * parts[k]:.1f}" for k in BREAKDOWN_PARTS)
        + " |"
        for mode, runs in plugin_modes(payload).items()
        for batch, run in runs.items()
        if isinstance(run, dict) and (parts := run.get("breakdown_s_per_decode_token"))
    ]
    if not rows:
        return []
    return [
        "Where a decode token's time goes, measured (ms per generated token): the expert "
        "kernel on resident experts, the wait for reads, the wait for the host and peers, "
        "the engine's own work in the MoE calls, the draft, the token scheduler, and the "
        "rest of the step (attention, dense layers, sampling, vLLM):",
        "",
        "| mode | seq | " + " | ".join(k.replace("_", " ") for k in BREAKDOWN_PARTS) + " |",
        "|---|---|" + "---|" * len(BREAKDOWN_PARTS),
        *rows,
        "",
    ]


def budget_estimate(quality: dict | None) -> str:
    """The quality budget's estimated accuracy loss, its samples, and whether it judged."""
    if not quality or quality.get("accuracy_loss") is None:
        return "-"
    judged = "judged" if quality.get("judged") else "not judged"
    return (
        f"{100 * quality['accuracy_loss']:.1f} % from {quality['sampled_tokens']} samples "
        f"({judged}, window {quality['window']})"
    )


def markdown(payload: dict, command: str) -> str:
    """The tables for the docs: decode tok/s, then GB read per decode token (with the
    clairvoyant bound beside the plugin's), per engine and batch."""
    batches = payload["batches"]
    llama = payload.get("llamacpp", {}).get("runs", {})
    plugin = plugin_modes(payload)

    def table(title: str, key: str, digits: int, bounds: bool = False) -> list[str]:
        head = "| engine | " + " | ".join(f"{b} seq" for b in batches) + " |"
        lines = [title, "", head, "|---|" + "---|" * len(batches)]

        def row(name: str, rows: dict, field: str) -> None:
            cells = [
                f"{rows[str(b)][field]:.{digits}f}" if field in rows.get(str(b), {}) else "-"
                for b in batches
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")

        for setting, rows in llama.items():
            row(f"llama.cpp, {setting}", rows, key)
        if "vanilla" in payload:
            outcome = payload["vanilla"]["outcome"]
            lines.append(f"| vanilla vLLM | {outcome} |" + " |" * (len(batches) - 1))
        for mode, rows in plugin.items():
            if "refused" in rows:
                refusal = rows["refused"].split(": ", 1)[-1].split(".")[0]
                lines.append(f"| plugin, {mode} | refused: {refusal} |" + " |" * (len(batches) - 1))
                continue
            row(f"plugin, {mode}", rows, key)
            if bounds and mode == "fetch, LRU":
                row("  LRU replayed on its calls", rows, "lru_replayed_gb_per_decode_token")
            reads = any(rows.get(str(b), {}).get(key, 0) > 0 for b in batches)
            if (
                bounds
                and reads
                and "clairvoyant_gb_per_decode_token" in rows.get(str(batches[0]), {})
            ):
                row("  Belady's MIN on the same calls", rows, "clairvoyant_gb_per_decode_token")
                row(
                    "  Belady's MIN, all layers' slots and the region as one cache",
                    rows,
                    "clairvoyant_pooled_gb_per_decode_token",
                )
                row("  the read-once bound of its calls", rows, "read_once_gb_per_decode_token")
                row(
                    "  the read-once bound of every slot and row",
                    rows,
                    "read_once_pooled_gb_per_decode_token",
                )
        for phase in PHASES:  # (what it measured before it died is in the rows above)
            died = payload.get(phase, {}).get("died")
            if died:
                cause = died.get("cause", f"exit {died['returncode']}")
                lines.append(f"| {phase} phase | {cause} |" + " |" * (len(batches) - 1))
        return [*lines, ""]

    def gb(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    limited = {
        p: payload[p]["memory_cgroup"] for p in PHASES if "memory_cgroup" in payload.get(p, {})
    }
    cgroups = []
    if limited:
        cgroups = [
            "Each phase's memory cgroup (GB; page cache counts to its usage):",
            "",
            "| phase | limit | peak | OOM kills | page cache at the end |",
            "|---|---|---|---|---|",
            *(
                f"| {phase} | {gb(m['limit_gb'])} | {gb(m['peak_gb'])} | "
                f"{'-' if m['oom_kills'] is None else m['oom_kills']} | "
                f"{gb(m['page_cache_gb_end'])} |"
                for phase, m in limited.items()
            ),
            "",
        ]

    last = str(batches[-1])
    memory_rows = [
        f"| {mode} | "
        + " | ".join(f"{rows[last]['memory_now'][k]:.2f}" for k in MEMORY_PARTS)
        + " |"
        for mode, rows in plugin.items()
        if "memory_now" in rows.get(last, {})
    ]
    memory_table = [
        f"The plugin's resident memory after the {last}-sequence run (GB): its host cache, "
        "and beyond it the KV cache and the rest (vLLM, torch, the dense weights, the "
        "passes' scratch, the libraries):",
        "",
        "| mode | cache | beyond the cache | KV cache | beyond the cache and the KV cache |",
        "|---|---|---|---|---|",
        *memory_rows,
        "",
    ]
    approximate = payload.get("approximate", {}).get("modes", {})
    accuracy_rows = [
        f"| {mode} | {a['accuracy']:.4f} | {a['kept']:.3f} | {a['top1_equal_exact']:.3f} "
        f"| {budget_estimate(a.get('quality'))} |"
        for mode, rows in approximate.items()
        if (a := rows.get("accuracy"))
    ]
    positions = next(
        (a["positions"] for rows in approximate.values() if (a := rows.get("accuracy"))), None
    )
    accuracy_table = [
        f"Next-token accuracy on held-out code (teacher-forced, {positions} positions), in "
        "the approximate phase's engine (its quality budget on), and the budget's own "
        "estimate over the accuracy run (not judged: its sampled tokens never filled a "
        "window):",
        "",
        "| mode | accuracy | kept (of fetch's) | top-1 equal to fetch's "
        "| the budget's estimate of the loss |",
        "|---|---|---|---|---|",
        *accuracy_rows,
        "",
    ]
    check_rows = [
        f"| {mode} | "
        + " | ".join(
            f"{rows[str(b)]['check_s']:.2f} s, {100 * rows[str(b)]['check_share_of_run']:.1f} %"
            if "check_s" in rows.get(str(b), {})
            else "-"
            for b in batches
        )
        + " |"
        for mode, rows in plugin.items()
        if any("check_s" in rows.get(str(b), {}) for b in batches)
    ]
    check_table = [
        "The mapped residency's checksum checks (an expert at first use, when its pages "
        "were read in): seconds in the run (prefill and decode), and their share of it:",
        "",
        "| mode | " + " | ".join(f"{b} seq" for b in batches) + " |",
        "|---|" + "---|" * len(batches),
        *check_rows,
        "",
    ]
    lines = [
        f"Real I/O, nothing modeled. `{command}`",
        "",
        *table("Decode tok/s:", "decode_tok_s", 3),
        *headroom_table(payload),
        *breakdown_table(payload),
        *table("GB read from disk per decode token:", "gb_read_per_decode_token", 3, True),
        *table(
            "The disk's busy share of the decode steps (time with a read in flight / decode "
            "time; slots residency):",
            "disk_busy_share_of_decode",
            2,
        ),
        *(check_table if check_rows else []),
        *(memory_table if memory_rows else []),
        *(accuracy_table if accuracy_rows else []),
        *cgroups,
    ]
    sweep = payload.get("sweep", {}).get("runs", {})
    if sweep:
        lines += [
            "`fetch` + LRU by host cache, decode tok/s:",
            "",
            "| host cache | slots per layer (GB) | "
            + " | ".join(f"{b} seq" for b in batches)
            + " |",
            "|---|---|" + "---|" * len(batches),
        ]
        for label, rows in sweep.items():
            if "refused" in rows:
                lines.append(f"| {label} | refused | " + " | ".join("" for _ in batches) + " |")
                continue
            cache = rows["host_cache"]
            cells = [
                f"{rows[str(b)]['decode_tok_s']:.3f}" if str(b) in rows else "-" for b in batches
            ]
            lines.append(
                f"| {label} | {cache['slots_per_layer']} ({cache['gb']:.1f}) | "
                + " | ".join(cells)
                + " |"
            )
    return "\n".join(lines)


def plot(payload: dict, path: Path) -> None:
    """Decode tok/s per engine at each batch, and the plugin's GB read per decode token
    beside LRU replayed and Belady's MIN on the same calls."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = payload["batches"]

    def tok_s(runs: dict) -> list[float]:
        return [runs.get(str(b), {}).get("decode_tok_s", 0) for b in batches]

    rows = {
        f"llama.cpp, {setting}": tok_s(runs)
        for setting, runs in payload.get("llamacpp", {}).get("runs", {}).items()
    }
    for mode, runs in plugin_modes(payload).items():
        if "refused" not in runs:
            rows[f"plugin, {mode}"] = tok_s(runs)
    fig, (left, right, parts) = plt.subplots(1, 3, figsize=(20, 6.4))
    width = 0.8 / max(len(rows), 1)
    colors = plt.get_cmap("tab20").colors  # (one color per engine: up to 20 rows)
    for i, (name, values) in enumerate(rows.items()):
        left.bar(
            [b + i * width for b in range(len(batches))],
            values,
            width,
            label=name,
            color=colors[i % len(colors)],
        )
    ticks = [f"{b} seq" for b in batches]
    left.set_xticks([b + 0.4 - width / 2 for b in range(len(batches))], ticks)
    left.set_ylabel("decode tok/s")
    limit, ratio = payload.get("memory_limit_gb"), payload.get("ram_ratio")
    size = "1.28x RAM"  # (the full-size run's, measured)
    if limit:
        size = f"{ratio:g}x" if ratio else "over"
        size += f" a {limit:g} GB memory limit"
    left.set_title(f"Decode, a model {size} (real I/O)")
    # Below the bars, not over them: there are a dozen engines.
    left.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    lru = payload.get("plugin", {}).get("modes", {}).get("fetch, LRU", {})
    series = {
        "plugin, fetch + LRU": "gb_read_per_decode_token",
        "LRU replayed on its calls": "lru_replayed_gb_per_decode_token",
        "Belady's MIN on its calls": "clairvoyant_gb_per_decode_token",
    }
    for i, (name, key) in enumerate(series.items()):
        values = [lru.get(str(b), {}).get(key, 0) for b in batches]
        right.bar([b + i * 0.27 for b in range(len(batches))], values, 0.27, label=name)
    right.set_xticks([b + 0.27 for b in range(len(batches))], ticks)
    right.set_ylabel("GB read per decode token")
    right.set_title("The host cache's reads against the clairvoyant bound")
    right.legend(fontsize=7)
    plot_breakdown(parts, payload)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_breakdown(axes, payload: dict) -> None:
    """At the largest batch: each mode's decode token, ms, by :data:`BREAKDOWN_PARTS`
    (stacked), with the compute ceiling and ``fetch``'s disk bound as lines."""
    batch = str(payload["batches"][-1])
    runs = {
        mode: run[batch]["breakdown_s_per_decode_token"]
        for mode, run in plugin_modes(payload).items()
        if "breakdown_s_per_decode_token" in run.get(batch, {})
    }
    if not runs:
        axes.set_axis_off()
        return
    names = list(runs)
    left = np.zeros(len(names))
    for part in BREAKDOWN_PARTS:
        values = np.array([1e3 * max(runs[m][part], 0.0) for m in names])
        axes.barh(names, values, left=left, label=part.replace("_", " "))
        left += values
    room = payload.get("headroom", {}).get(batch, {})
    for key, style, label in (
        ("ceiling_s_per_token", "--", "compute ceiling"),
        ("disk_bound_s_per_token", ":", "fetch's disk bound"),
    ):
        if room.get(key):
            axes.axvline(1e3 * room[key], color="k", linestyle=style, label=label)
    axes.invert_yaxis()
    axes.tick_params(axis="y", labelsize=7)
    axes.set_xlabel("ms per generated token")
    axes.set_title(f"Where a decode token's time goes, {batch} seq (measured)")
    axes.legend(fontsize=7)


def report(name: str) -> None:
    """The tables and plot of an earlier run's result file, written beside it."""
    payload = json.loads((RESULTS / f"{name}.json").read_text())
    table = markdown(payload, payload["command"])
    (RESULTS / f"{name}.md").write_text(table)
    plot(payload, RESULTS / f"{name}.png")
    print(table)


if __name__ == "__main__":
    main()
