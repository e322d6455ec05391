"""What sizing a budget needs of vLLM's settings (:class:`SizingSettings`), read from a
vLLM config: the KV cache's explicit size or the share of memory vLLM sizes it from,
the KV bytes of a token, and the sequences and tokens a pass may hold. The MoE layers
are counted as the model builds them (:meth:`SizingSettings.count_layer`). On the CPU
build a KV cache given no size is sized for the batch (:func:`size_cpu_kv_cache`): under
the disk tier with ``budget: "auto"``, for the batch the memory serves best."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from vllm import envs
from vllm.platforms import current_platform
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

from vllm_specexpert.architectures import (
    SUPPORTED_ARCHITECTURES,
    expert_nbytes,
    moe_layer_count,
    moe_shape,
)
from vllm_specexpert.config.sizing import (
    ModelShapes,
    SizingSettings,
    best_batch,
    kv_cache_for_batch,
)
from vllm_specexpert.log import init_logger
from vllm_specexpert.tiers.memory import memory_report, process_anonymous_bytes

logger = init_logger(__name__)


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


def size_cpu_kv_cache(vllm_config: Any, batch_from_experts: bool = False) -> None:
    """The CPU build's KV cache, when no size is given, of the memory free now, given to
    vLLM as its size: :func:`kv_cache_for_batch`, or with ``batch_from_experts`` (experts
    read from a disk, the slots sized by ``auto``, an unquantized checkpoint)
    :func:`best_batch`'s, said on a start line. Called once the engine config is built,
    before any worker starts: vLLM's CPU worker without a size refuses to start unless
    ``gpu_memory_utilization`` of the node is free, and would then take that share,
    beside the slots the plugin sizes later."""
    cache = vllm_config.cache_config
    if not current_platform.is_cpu() or cache.kv_cache_memory_bytes is not None:
        return
    settings = sizing_settings(vllm_config)
    free = memory_report(torch.device("cpu"), settings).free_bytes
    if not batch_from_experts:
        cache.kv_cache_memory_bytes = kv_cache_for_batch(settings, free)
        return
    shapes = _config_time_shapes(vllm_config, settings)
    engine = engine_process_bytes(vllm_config) + other_weight_bytes(vllm_config, shapes)
    choice = best_batch(settings, free, shapes, engine)
    cache.kv_cache_memory_bytes = choice.kv_bytes
    logger.info("specexpert: %s", choice.reason)


ENGINE_PROCESS_GROWTH = 1.2
"""What an engine process holds before any weight, against the anonymous memory of the
process that configures it: they import the same libraries (torch, vLLM), and the engine's
own state comes on top. Measured 1.13x on the embedded model (this process 0.41 GB; the
engine core 0.45 GB and the worker 0.49 GB besides its slots and KV cache) and 1.18x on
the miniature in a 4 GB cgroup (2 slots a layer, 0.16 GB, fewer than 2 processes at 1x
modeled)."""


def engine_process_bytes(vllm_config: Any) -> int:
    """What the engine's own processes (vLLM's engine core and its workers, where they run
    apart from this one) will hold before any weight: :data:`ENGINE_PROCESS_GROWTH` times
    this process's anonymous memory each. Without this count the engine found 9 slots a
    layer where 22 were modeled (the miniature in a 4 GB cgroup)."""
    parallel = vllm_config.parallel_config
    processes = 1 if envs.VLLM_ENABLE_V1_MULTIPROCESSING else 0
    if parallel.distributed_executor_backend == "mp":
        processes += parallel.world_size
    return int(processes * ENGINE_PROCESS_GROWTH * process_anonymous_bytes())


def other_weight_bytes(vllm_config: Any, shapes: ModelShapes) -> int:
    """The model's weights besides its routed experts (attention, embeddings, the head),
    at the model's dtype, from the size of a local checkpoint's safetensors files; 0
    where the checkpoint is not a local directory. Qwen3-30B-A3B's are about 3 GB."""
    folder = Path(vllm_config.model_config.model)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return 0
    model = vllm_config.model_config
    stored = getattr(model.hf_config, "dtype", None)
    stored_bytes = stored.itemsize if isinstance(stored, torch.dtype) else model.dtype.itemsize
    experts = shapes.moe_layers * shapes.num_experts * shapes.expert_bytes
    experts_stored = experts * stored_bytes // model.dtype.itemsize
    total = sum(file.stat().st_size for file in files)
    return max(total - experts_stored, 0) * model.dtype.itemsize // stored_bytes


def _config_time_shapes(vllm_config: Any, settings: SizingSettings) -> ModelShapes:
    """The model's shapes as the config tells them, before any layer is built: its experts
    at the model's dtype."""
    model = vllm_config.model_config
    hf_config = model.hf_config
    shape = moe_shape(hf_config)
    architecture = SUPPORTED_ARCHITECTURES[shape.architecture]
    settings.moe_layers = moe_layer_count(hf_config)
    settings.moe_intermediate_size = int(getattr(hf_config, architecture.intermediate_attr))
    expert_bytes = expert_nbytes(hf_config, model.dtype.itemsize)
    return settings.shapes(shape.num_experts, shape.top_k, expert_bytes)
