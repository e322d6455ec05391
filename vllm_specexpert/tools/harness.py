"""Start vanilla and offloaded vLLM engines side by side, in one process.

Used by the demo, the benchmarks and the tests to compare the plugin against vanilla
vLLM on the same model. ``specexpert=None`` starts vanilla vLLM with no plugin loaded at
all in the engine processes (``VLLM_PLUGINS=""``), not merely the plugin unconfigured.
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any


@contextlib.contextmanager
def plugins_enabled(enabled: bool):
    """While active, engine processes started here load plugins only if ``enabled``."""
    saved = os.environ.get("VLLM_PLUGINS")
    if not enabled:
        os.environ["VLLM_PLUGINS"] = ""
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("VLLM_PLUGINS", None)
        else:
            os.environ["VLLM_PLUGINS"] = saved


def start_engine(
    model: str,
    specexpert: dict[str, Any] | None = None,
    eager: bool = True,
    plugins: bool | None = None,
    max_model_len: int = 1024,
    **kwargs: Any,
):
    """An ``LLM`` on ``model`` in bf16 with a fixed seed. ``plugins`` defaults to
    ``specexpert is not None``; pass ``plugins=True`` with ``specexpert=None`` for the
    plugin loaded but unconfigured."""
    if specexpert is None:  # (a configured plugin gives vLLM the KV cache its plan sized)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from vllm_specexpert.plugins import register

    # vLLM loads plugins once per process: if this process's first engine was vanilla
    # (VLLM_PLUGINS=""), the main-process half of the plugin was never installed.
    register()
    extra = {"additional_config": {"specexpert": specexpert}} if specexpert is not None else {}
    with plugins_enabled(specexpert is not None if plugins is None else plugins):
        return LLM(
            model=model,
            dtype="bfloat16",
            enforce_eager=eager,
            max_model_len=max_model_len,
            seed=0,
            **extra,
            **kwargs,
        )


def stop_engine(llm) -> None:
    """Shut the engine processes down now rather than at garbage collection."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def decode_seconds(model, runs: int = 20) -> float:
    """Worker side (``llm.apply_model``): median seconds to decode one expert of the
    first offloaded layer into its slot form (a packed layer's dequantize and vLLM's
    post-processing; 0.0 for a bf16 layer, whose slots are plain copies)."""
    import statistics
    import time

    import torch

    from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts

    layer = next(m for m in model.modules() if isinstance(m, OffloadedRoutedExperts))
    experts = layer.engine.layers[layer.layer_name].experts
    if experts.decoder is None:
        return 0.0
    times = []
    for run in range(runs):
        start = time.perf_counter()
        experts.decoded(torch.tensor([run % experts.num_experts]))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
