"""What sizing a budget needs of vLLM's settings (:class:`SizingSettings`), read from a
vLLM config: the KV cache's explicit size or the share of memory vLLM sizes it from,
the KV bytes of a token, and the sequences and tokens a pass may hold. The MoE layers
are counted as the model builds them (:meth:`SizingSettings.count_layer`). On the CPU
build a KV cache given no size is sized for the batch (:func:`size_cpu_kv_cache`)."""

from __future__ import annotations

from typing import Any

import torch
from vllm.platforms import current_platform
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

from vllm_specexpert.config.sizing import SizingSettings, kv_cache_for_batch
from vllm_specexpert.tiers.memory import memory_report


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
        # CPU build the plugin gives one: size_cpu_kv_cache).
        utilization=1.0 if explicit is not None else cache.gpu_memory_utilization,
        kv_cache_bytes=explicit,
        kv_bytes_per_token=kv_per_token,
        max_num_seqs=scheduler.max_num_seqs,
        max_model_len=model.max_model_len,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        block_size=cache.block_size or 0,
        hidden_size=model.get_hidden_size(),
    )


def size_cpu_kv_cache(vllm_config: Any) -> None:
    """The CPU build's KV cache, when no size is given: :func:`kv_cache_for_batch` of the
    memory free now, given to vLLM as its size. Called once the engine config is built,
    before any worker starts: vLLM's CPU worker without a size refuses to start unless
    ``gpu_memory_utilization`` of the node is free, and would then take that share,
    beside the slots the plugin sizes later."""
    cache = vllm_config.cache_config
    if not current_platform.is_cpu() or cache.kv_cache_memory_bytes is not None:
        return
    settings = sizing_settings(vllm_config)
    free = memory_report(torch.device("cpu"), settings).free_bytes
    cache.kv_cache_memory_bytes = kv_cache_for_batch(settings, free)
