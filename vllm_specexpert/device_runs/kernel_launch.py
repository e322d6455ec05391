"""One kernel launch on resident experts, the one way every device run launches: the
call's ``before_kernel`` first, then the layer's kernel on the cache's slots, a long pass
(prefill) in chunks of :data:`~vllm_specexpert.config.sizing.KERNEL_CHUNK_TOKENS` rows."""

from __future__ import annotations

import time

import numpy as np
import torch

from vllm_specexpert.config.sizing import KERNEL_CHUNK_TOKENS
from vllm_specexpert.layer_call import ExpertKernel, LayerCall
from vllm_specexpert.tiers.cache import KernelRouting
from vllm_specexpert.tiers.loader import ExpertLoader


def launch(loader: ExpertLoader, call: LayerCall, experts: np.ndarray) -> torch.Tensor:
    """One kernel launch on resident ``experts`` (those of the call's ids), after the
    call's ``before_kernel``."""
    cache = loader.cache
    hook = call.take_before_kernel()
    if hook is not None:
        cache.in_use[experts] = True  # the hook's loads (other layers') must not take them
        try:
            hook()
        finally:
            cache.in_use[experts] = False
    routing = cache.kernel_routing(call.topk_ids, call.host_ids)
    started = time.perf_counter()
    read, nbytes = cache.pool.readable(routing.ids)  # (a mapped pack's pages: its loads)
    readable = time.perf_counter()
    if read:
        call.stats.stall_s += readable - started
    call.stats.loads += read
    call.stats.bytes_loaded += nbytes
    out = in_chunks(call.kernel, call.x, call.topk_weights, routing)
    cache.pool.confirm(routing.ids)  # (a mapped pack's pages: unwritten while it ran)
    call.stats.kernel_s += time.perf_counter() - readable
    loader.kernel_launched(experts)
    call.stats.kernel_calls += 1
    return out


def in_chunks(
    kernel: ExpertKernel, x: torch.Tensor, weights: torch.Tensor, routing: KernelRouting
) -> torch.Tensor:
    """The layer's kernel on the cache's slots; a long pass (prefill) in chunks, so that
    the kernel's scratch is a chunk's, not the pass's."""
    ids, slots, expert_map = routing
    tokens = x.shape[0]
    if tokens <= KERNEL_CHUNK_TOKENS:
        return kernel(x, weights, ids, slots, expert_map)
    out = torch.empty_like(x)
    for start in range(0, tokens, KERNEL_CHUNK_TOKENS):
        rows = slice(start, start + KERNEL_CHUNK_TOKENS)
        out[rows] = kernel(x[rows], weights[rows], ids[rows], slots, expert_map)
    return out
