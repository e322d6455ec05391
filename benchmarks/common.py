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
