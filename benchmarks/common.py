"""Shared pieces of the benchmarks: engines, timing, and result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = Path(__file__).resolve().parent / "results"


def command_line() -> str:
    return " ".join([Path(sys.executable).name, *sys.argv])


def timed_generate(llm, prompts: list, max_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def decode_step_seconds(llm, prompts: list, max_tokens: int, repeats: int) -> float:
    """Median seconds per decode step: (time for max_tokens - time for 1 token) / steps,
    so prefill and request overheads cancel out."""
    full = [timed_generate(llm, prompts, max_tokens) for _ in range(repeats)]
    first = [timed_generate(llm, prompts, 1) for _ in range(repeats)]
    return (statistics.median(full) - statistics.median(first)) / (max_tokens - 1)


def emulated_link(layer_seconds: float, expert_bytes: int, copy_compute_ratio: float,
                  latency_us: float) -> dict[str, float]:
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


def link_like_a_gpu_box(vanilla, plugin, args) -> tuple[dict[str, float], float, int]:
    """The emulated link of :func:`emulated_link` for this model, measured on the vanilla
    engine. Returns (link config, vanilla batch-1 decode step seconds, bytes per expert)."""
    import vllm_specexpert

    prompt = held_out_prompts(1)
    timed_generate(vanilla, prompt, 8)
    step = decode_step_seconds(vanilla, prompt, 48, 2)
    info = vllm_specexpert.get_stats(plugin)[0]
    expert_bytes = next(iter(info["expert_bytes"].values()))
    link = emulated_link(step / len(info["layers"]), expert_bytes, args.copy_compute_ratio,
                         args.latency_us)
    print(f"vanilla batch-1 step {step * 1e3:.2f} ms; emulated link "
          f"{link['bandwidth_gbps']:.4f} GB/s + {args.latency_us} us/copy "
          f"({expert_bytes / link['bandwidth_gbps'] / 1e3:.0f} us per expert)")
    return link, step, expert_bytes


def held_out_prompts(count: int, tokens: int = 32) -> list[str]:
    """``count`` prompts: the first ``tokens`` tokens of the corpus's validation files
    (held-out text, never trained on), longest files first."""
    from vllm_specexpert.tools import corpus
    from vllm_specexpert.tools.fixtures import load_tokenizer

    tokenizer = load_tokenizer()
    files = sorted(corpus.corpus_files("validation"), key=lambda f: -f.size)
    return [tokenizer.decode(tokenizer.encode(f.read()).ids[:tokens]) for f in files[:count]]


def default_calibration(model: str, max_tokens: int = 65536) -> str:
    """A calibration of ``model`` on the corpus's train split: the shipped one for the
    embedded model, otherwise made once and cached under ``$SPECEXPERT_CACHE/calibration``."""
    import hashlib

    from vllm_specexpert.tools.fixtures import TRAINED_CALIBRATION_DIR, TRAINED_MODEL_DIR

    if Path(model).resolve() == TRAINED_MODEL_DIR.resolve():
        return str(TRAINED_CALIBRATION_DIR)

    from vllm_specexpert.calibration import load_calibration
    from vllm_specexpert.config import SpecExpertConfigError
    from vllm_specexpert.tools.calibrate import calibrate
    from vllm_specexpert.tools.fixtures import DEFAULT_OUT
    from vllm_specexpert.tools.trace import corpus_documents

    key = hashlib.sha256(f"{Path(model).resolve()}:{max_tokens}".encode()).hexdigest()[:12]
    out = DEFAULT_OUT.parent / "calibration" / f"{Path(model).name}-{key}"
    try:
        load_calibration(out, model=model)
    except SpecExpertConfigError:
        print(f"calibrating {model} on {max_tokens} train tokens -> {out}")
        calibrate(model, corpus_documents("train"), out, max_tokens=max_tokens,
                  description=f"corpus split train, first {max_tokens} tokens")
    return str(out)


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
