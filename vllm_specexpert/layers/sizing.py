"""What sizing a budget needs of vLLM's settings (:class:`SizingSettings`), read from a
vLLM config: the KV cache's explicit size or the share of memory vLLM sizes it from,
the KV bytes of a token, and the sequences and tokens a pass may hold. The MoE layers
are counted as the model builds them (:meth:`SizingSettings.count_layer`). On the CPU
build a KV cache given no size gets the plan's (:func:`give_planned_kv_cache`)."""

from __future__ import annotations

from typing import Any

from vllm.platforms import current_platform
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

from vllm_specexpert.config.sizing import BudgetFit, SizingSettings


def sizing_settings(vllm_config: Any) -> SizingSettings:
    model, cache = vllm_config.model_config, vllm_config.cache_config
    parallel, scheduler = vllm_config.parallel_config, vllm_config.scheduler_config
    kv_dtype = kv_cache_dtype_str_to_dtype(cache.cache_dtype, model)
    kv_per_token = (
        2
        * model.get_num_layers(parallel)
        * model.get_num_kv_heads(parallel)
        * model.get_head_size()
        * kv_dtype.itemsize
    )
    explicit = cache.kv_cache_memory_bytes
    return SizingSettings(
        # vLLM sizes the KV cache from its share of memory unless given a size (on the
        # CPU build it is given the plan's: give_planned_kv_cache).
        utilization=(
            1.0
            if explicit is not None or current_platform.is_cpu()
            else cache.gpu_memory_utilization
        ),
        kv_cache_bytes=explicit,
        kv_bytes_per_token=kv_per_token,
        max_num_seqs=scheduler.max_num_seqs,
        max_model_len=model.max_model_len,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
    )


def give_planned_kv_cache(cache_config: Any, fit: BudgetFit) -> None:
    """The CPU build's KV cache, given no size, is the one the start's plan left room
    for: ``max_num_seqs`` full-length sequences, or ``KV_SHARE`` of the free memory
    (``config/sizing.py``). vLLM's own CPU sizing takes a share of the node's memory
    that the slots have taken by then, and fails or takes what the plan did not leave.
    Called once the start's plan is adopted (the weights are loaded; vLLM sizes the KV
    cache after)."""
    if current_platform.is_cpu() and cache_config.kv_cache_memory_bytes is None:
        if "kv_full" in fit.parts:  # (sized here, not given)
            cache_config.kv_cache_memory_bytes = int(fit.parts["kv"])
