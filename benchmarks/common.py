"""Shared pieces of the benchmarks: engines, timing, held-out text, teacher-forced decode,
decode-only figures, the emulated link, and result files.

Every per-token figure is decode-only: the engine counts decode and prefill tokens
separately (vLLM's split), and :func:`decode_figures` divides the decode counters by the
decode tokens. Prefill counters are reported beside them (:func:`prefill_figures`). A
figure that depends on the emulated link or the emulated host speed is *modeled*: results
carry the constants (:func:`modeled`) and plots say so.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_specexpert.tools.teacher_forcing import (  # noqa: F401 - shared by the scripts
    held_out_windows,
    teacher_forced,
)

REPOSITORY = Path(__file__).resolve().parent.parent
if str(REPOSITORY) not in sys.path:
    # The test bed (specexpert_testbed: fixtures, default models) is the repository's,
    # not the wheel's: the scripts import it from here.
    sys.path.append(str(REPOSITORY))

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = Path(__file__).resolve().parent / "results"


def kib(path: str, key: str) -> int:
    """A ``key: N kB`` line of a ``/proc`` file (``/proc/meminfo``, ``/proc/<pid>/status``)."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    return 0


def work_dir(name: str) -> Path:
    """Where a benchmark keeps what it makes: ``$SPECEXPERT_CACHE/name`` (default
    ``~/.cache/specexpert/name``)."""
    return Path(os.environ.get("SPECEXPERT_CACHE", Path.home() / ".cache" / "specexpert")) / name


def command_line() -> str:
    """The command that is running, quoted so that it can be pasted into a shell."""
    return shlex.join([Path(sys.executable).name, *sys.argv])


def timed_generate(llm, prompts: list, max_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def stepped_generate(
    llm, prompts: list, max_tokens: int, at_decode: Callable[[], None] | None = None
) -> tuple[float, list[tuple[float, int]]]:
    """``(prefill, decode)``: greedy generation driven one engine step at a time (the
    engine core in this process), each step timed: the seconds of the steps until every
    request has its first token, and each later (decode) step's seconds and the tokens
    it made (fewer than the requests when a scheduler holds some back). Unlike the
    difference of two runs (:func:`step_seconds`), nothing depends on the state a second
    run meets (a cache that the first run warmed). ``at_decode``: called once, untimed,
    before the first decode step (to read counters at the prefill's end)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.llm_engine
    tag = f"stepped-{time.monotonic_ns()}"
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    made: dict[str, int] = {}
    prefill, decode = 0.0, []
    while engine.has_unfinished_requests():
        decoding = len(made) == len(prompts)
        if decoding and not decode and at_decode is not None:
            at_decode()
        before = sum(made.values())
        begun = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - begun
        for output in outputs:
            if output.outputs and output.outputs[0].token_ids:
                made[output.request_id] = len(output.outputs[0].token_ids)
        if decoding:
            decode.append((seconds, sum(made.values()) - before))
        else:
            prefill += seconds
    return prefill, decode


def step_seconds(llm, prompts: list, max_tokens: int, repeats: int) -> tuple[float, float]:
    """``(decode, first)``: median seconds per decode step, ``(time for max_tokens - time
    for 1 token) / (max_tokens - 1)`` so that prefill and request overheads cancel out,
    and median seconds to the first token (the prompts' prefill pass, reported apart)."""
    full = [timed_generate(llm, prompts, max_tokens) for _ in range(repeats)]
    first = [timed_generate(llm, prompts, 1) for _ in range(repeats)]
    decode = (statistics.median(full) - statistics.median(first)) / (max_tokens - 1)
    return decode, statistics.median(first)


def decode_figures(stats: dict) -> dict[str, Any]:
    """Per-decode-token figures of one worker's stats (``vllm_specexpert.get_stats``):
    the decode counters only, divided by the decode tokens."""
    d, n = stats["total"]["decode"], max(stats["decode_tokens"], 1)
    return {
        "decode_tokens": stats["decode_tokens"],
        "hit_rate": d["hit_rate"],
        "misses_per_token": d["misses"] / n,
        "loads_per_token": d["loads"] / n,
        "mb_per_token": d["bytes_loaded"] / n / 1e6,
        "stall_ms_per_token": d["stall_s"] / n * 1e3,
        "host_ms_per_token": d.get("host_s", 0.0) / n * 1e3,  # (a place's: when it is on)
        "prefetched_per_token": d["prefetched"] / n,
        "prefetch_used_per_token": d["prefetch_used"] / n,
        "recall": d["recall"] if d.get("predicted") else None,  # (while a predictor runs)
        "entries_per_token": {
            k: d.get(f"{k}_entries", 0) / n
            for k in ("missed", "fetched", "host", "substituted", "dropped", "low_bit")
        },
        "low_bit_mb_per_token": d.get("low_bit_bytes", 0) / n / 1e6,
    }


def prefill_figures(stats: dict) -> dict[str, Any]:
    """The prefill counters of the same stats, in totals (reported beside the decode
    figures, never mixed into them)."""
    p = stats["total"]["prefill"]
    return {
        "prefill_tokens": stats["prefill_tokens"],
        "misses": p["misses"],
        "loads": p["loads"],
        "mb": p["bytes_loaded"] / 1e6,
        "stall_ms": p["stall_s"] * 1e3,
        "kernel_calls": p["kernel_calls"],
    }


def modeled(
    link: dict, copy_compute_ratio: float, host_slowdown: float = 14.0, **extra: Any
) -> dict[str, Any]:
    """The constants a modeled figure depends on, for the result file."""
    return {
        "emulated_link": {
            "bandwidth_gbps": link["bandwidth_gbps"],
            "latency_us": link["latency_us"],
            "copy_compute_ratio": copy_compute_ratio,
        },
        "host_slowdown": host_slowdown,
        **extra,
    }


def modeled_label(link: dict, copy_compute_ratio: float, host_slowdown: float = 14.0) -> str:
    """One line for plots: what the modeled figures assume."""
    return (
        f"MODELED: emulated link {link['bandwidth_gbps']:.3g} GB/s + {link['latency_us']:g} "
        f"us/copy (copy = {copy_compute_ratio:g}x one layer's decode compute), "
        f"host_slowdown {host_slowdown:g}"
    )


def emulated_link(
    layer_seconds: float, expert_bytes: int, copy_compute_ratio: float, latency_us: float
) -> dict[str, float]:
    """An emulated link on which one expert copy takes ``copy_compute_ratio`` times one
    MoE layer's decode compute (``layer_seconds``), so that a CPU run sees a GPU box's
    copy/compute ratio. The default ratio used by the benchmarks, 2.7, comes from a
    9.4 MB Qwen3-30B-A3B expert over ~25 GB/s PCIe 4.0 (0.38 ms) against ~0.14 ms per
    layer of batch-1 decode on an RTX 4090-class GPU: an estimate, not a measurement."""
    copy_s = copy_compute_ratio * layer_seconds
    return {"bandwidth_gbps": expert_bytes / copy_s / 1e9, "latency_us": latency_us}


def add_engine_arguments(parser, name: str) -> None:
    """Arguments every engine benchmark takes: model, calibration, link ratio, eager."""
    parser.add_argument("--model", help="model directory (default: the embedded model)")
    parser.add_argument("--calibration", help="calibration directory (default: made on first use)")
    parser.add_argument("--copy-compute-ratio", type=float, default=2.7)
    parser.add_argument("--latency-us", type=float, default=10.0)
    parser.add_argument("--eager", action="store_true", help="enforce_eager (default: compiled)")
    parser.add_argument("--name", default=name, help="result file name")


def add_predictor_arguments(parser) -> None:
    """The model and the predictors' artifacts (defaults: the embedded model's)."""
    parser.add_argument("--model", help="model directory (default: the embedded model)")
    parser.add_argument("--calibration", help="calibration directory (default: made on first use)")
    parser.add_argument("--estimator", help="estimator directory (default: the embedded model's)")
    parser.add_argument(
        "--analysis", help="analysis directory for hybrid (default: the embedded model's)"
    )


def estimator_artifacts(model: str, args) -> dict:
    """``estimator`` and ``analysis`` for the config: given, the embedded model's, or
    none (the estimator modes are then left out, said on stdout)."""
    from vllm_specexpert.tools.embedded_model import (
        TRAINED_ANALYSIS_DIR,
        TRAINED_ESTIMATOR_DIR,
        TRAINED_MODEL_DIR,
    )

    embedded = Path(model).resolve() == TRAINED_MODEL_DIR.resolve()
    estimator = args.estimator or (str(TRAINED_ESTIMATOR_DIR) if embedded else None)
    analysis = args.analysis or (str(TRAINED_ANALYSIS_DIR) if embedded else None)
    if estimator is None or analysis is None:
        print(
            "estimator and hybrid left out: give --estimator (specexpert "
            "train-estimator) and --analysis (specexpert analyze --estimator)"
        )
        return {}
    return {"estimator": estimator, "analysis": analysis}


def link_like_a_gpu_box(vanilla, plugin, args) -> tuple[dict[str, float], float, int]:
    """The emulated link of :func:`emulated_link` for this model, measured on the vanilla
    engine. Returns (link config, vanilla batch-1 decode step seconds, bytes per expert)."""
    import vllm_specexpert

    prompt = held_out_prompts(1)
    timed_generate(vanilla, prompt, 8)
    step, _ = step_seconds(vanilla, prompt, 48, 2)
    info = vllm_specexpert.get_stats(plugin)[0]
    expert_bytes = next(iter(info["expert_bytes"].values()))
    link = emulated_link(
        step / len(info["layers"]), expert_bytes, args.copy_compute_ratio, args.latency_us
    )
    print(
        f"vanilla batch-1 step {step * 1e3:.2f} ms; emulated link "
        f"{link['bandwidth_gbps']:.4f} GB/s + {args.latency_us} us/copy "
        f"({expert_bytes / link['bandwidth_gbps'] / 1e3:.0f} us per expert)"
    )
    return link, step, expert_bytes


def model_of(args) -> str:
    """``--model``, or the embedded model (built on first use)."""
    from specexpert_testbed.fixtures import DEFAULT_MODEL, model_path

    return getattr(args, "model", None) or str(model_path(DEFAULT_MODEL))


def held_out_prompts(count: int, tokens: int = 32) -> list[str]:
    """``count`` prompts: the first ``tokens`` tokens of the corpus's validation files
    (held-out text, never trained on), longest files first."""
    from vllm_specexpert.tools import corpus
    from vllm_specexpert.tools.embedded_model import load_tokenizer

    tokenizer = load_tokenizer()
    files = sorted(corpus.corpus_files("validation"), key=lambda f: -f.size)
    return [tokenizer.decode(tokenizer.encode(f.read()).ids[:tokens]) for f in files[:count]]


def greedy_tokens(llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def agreement(candidate: list[list[int]], exact: list[list[int]]) -> dict:
    """Share of positions equal to ``exact``'s, and mean share before the first
    divergence."""
    same = [
        sum(a == b for a, b in zip(c, e, strict=True)) / len(e)
        for c, e in zip(candidate, exact, strict=True)
    ]
    prefix = []
    for c, e in zip(candidate, exact, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(c, e, strict=True)) if a != b), len(e))
        prefix.append(n / len(e))
    return {"agreement": sum(same) / len(same), "prefix": sum(prefix) / len(prefix)}


def default_calibration(model: str, max_tokens: int = 65536) -> str:
    """A calibration of ``model`` on the corpus's train split: the shipped one for the
    embedded model, otherwise made once and cached under ``$SPECEXPERT_CACHE/calibration``."""
    import hashlib

    from vllm_specexpert.tools.embedded_model import TRAINED_CALIBRATION_DIR, TRAINED_MODEL_DIR

    if Path(model).resolve() == TRAINED_MODEL_DIR.resolve():
        return str(TRAINED_CALIBRATION_DIR)

    from specexpert_testbed.fixtures import DEFAULT_OUT
    from vllm_specexpert.calibration import load_calibration
    from vllm_specexpert.config import SpecExpertConfigError
    from vllm_specexpert.tools.calibrate import calibrate
    from vllm_specexpert.tools.trace import corpus_documents

    key = hashlib.sha256(f"{Path(model).resolve()}:{max_tokens}".encode()).hexdigest()[:12]
    out = DEFAULT_OUT.parent / "calibration" / f"{Path(model).name}-{key}"
    try:
        load_calibration(out, model=model)
    except SpecExpertConfigError:
        print(f"calibrating {model} on {max_tokens} train tokens -> {out}")
        calibrate(
            model,
            corpus_documents("train"),
            out,
            max_tokens=max_tokens,
            description=f"corpus split train, first {max_tokens} tokens",
        )
    return str(out)


def write_outputs(
    name: str, payload: dict[str, Any], table: str, plot: Callable[[dict, Path], None]
) -> Path:
    """A run's JSON, its table (``.md``) and its figure (``.png``), the table printed."""
    out = write_result(name, payload)
    (RESULTS / f"{name}.md").write_text(table)
    plot(payload, RESULTS / f"{name}.png")
    print(table)
    return out


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    payload = {
        "command": command_line(),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        **payload,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path
