"""One kernel launch on resident experts, the one way every device run launches: the
call's :class:`~vllm_specexpert.layer_call.FirstLaunch` first, then the layer's kernel
on the cache's slots, a long pass (prefill) in chunks of
:data:`~vllm_specexpert.config.sizing.KERNEL_CHUNK_TOKENS` rows."""

from __future__ import annotations

import time

import numpy as np
import torch

from vllm_specexpert.config.sizing import KERNEL_CHUNK_TOKENS
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.tiers.cache import KernelRouting
from vllm_specexpert.tiers.loader import ExpertLoader


def launch(loader: ExpertLoader, call: LayerCall, experts: np.ndarray) -> torch.Tensor:
    """One kernel launch on resident ``experts`` (those of the call's ids), after the
    call's first-launch work (if no launch of the call ran it yet)."""
    cache, first = loader.cache, call.first_launch
    if first.pending:
        cache.in_use[experts] = True  # the hooks' loads (other layers') must not take them
        try:
            first.run()
        finally:
            cache.in_use[experts] = False
    routing = cache.kernel_routing(call.topk_ids, call.host_ids)
    pool, readable = cache.pool, time.perf_counter()
    if not pool.readable_as_is:  # (a mapped pack's pages: its loads)
        read, nbytes = pool.readable(routing.ids)
        started, readable = readable, time.perf_counter()
        if read:
            call.stats.stall_s += readable - started
        call.stats.loads += read
        call.stats.bytes_loaded += nbytes
    out = in_chunks(call, routing)
    if not pool.readable_as_is:  # (a mapped pack's pages: unwritten while it ran)
        pool.confirm(routing.ids)
    call.stats.kernel_s += time.perf_counter() - readable
    loader.kernel_launched(experts)
    call.stats.kernel_calls += 1
    return out


def in_chunks(call: LayerCall, routing: KernelRouting) -> torch.Tensor:
    """The layer's kernel on the cache's slots, into the call's ``out`` if it has one;
    a long pass (prefill) in chunks, so that the kernel's scratch is a chunk's, not the
    pass's."""
    ids, slots, expert_map = routing
    kernel, x, weights, tiles = call.kernel, call.x, call.topk_weights, call.tile_tokens
    tokens = x.shape[0]
    if tokens <= KERNEL_CHUNK_TOKENS:
        return kernel(x, weights, ids, slots, expert_map, out=call.out, tile_tokens=tiles)
    out = torch.empty_like(x) if call.out is None else call.out
    for start in range(0, tokens, KERNEL_CHUNK_TOKENS):
        rows = slice(start, start + KERNEL_CHUNK_TOKENS)
        out[rows] = kernel(x[rows], weights[rows], ids[rows], slots, expert_map, tile_tokens=tiles)
    return out
