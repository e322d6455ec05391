"""A call whose experts do not fit the pool, each missing expert read once (``stream``:
equivalent, not exact): one launch on the resident entries (a token whose experts are
all resident runs whole: exactly), then the missing experts in windows, in id order (the
pack's file order), each window's entries launched as one-entry tokens. A token split
over launches gets the kernel's bf16 results added in fp32 and rounded once: equal to
the whole token's up to rounding.

The reads overlap the compute (the demand is known): a window's reads are queued before
the launch ahead of it, into slots that launch does not need, so the disk reads while
the kernel runs. Windows are :func:`stream_window` experts, one computing while the next
fills; the first takes slots of resident experts this call does not need. What a window
evicts is the least used of the rest (the policy's
:meth:`~vllm_specexpert.tiers.eviction.EvictionPolicy.sweep_demand`), so the pool keeps,
for the next call, the experts used most, and the missing ones stream through two
windows' slots."""

from __future__ import annotations

import numpy as np
import torch

from vllm_specexpert.device_runs import kernel_launch
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.stats import PhaseStats
from vllm_specexpert.tiers.cache import ExpertCache
from vllm_specexpert.tiers.loader import ExpertLoader
from vllm_specexpert.tiers.staging import upload


class Streamed:
    """What does not fit streams through windows, each missing expert read once."""

    def run(self, loader: ExpertLoader, call: LayerCall) -> torch.Tensor:
        cache, ids, stats, device = loader.cache, call.host_ids, call.stats, call.x.device
        held = cache.resident_mask()[ids]
        out = torch.zeros_like(call.x)
        resident = np.unique(ids[held])
        rest = np.unique(ids[~held])  # (ascending: the pack's order)
        pending = np.zeros(0, dtype=np.int64)
        size = stream_window(cache)
        try:
            window, rest = _next_window(cache, rest, resident, size)
            pending = _request(loader, window, resident, stats)
            if len(resident):
                loader.acquire(resident, stats, tokens=call.num_tokens)  # (hits)
                index, part = call.masked(held)
                out[index] = kernel_launch.launch(loader, part, resident)
            split = np.flatnonzero(~held.all(axis=1))
            row_of = np.zeros(len(ids), dtype=np.int64)
            row_of[split] = np.arange(len(split))
            total = out[upload(split, device)].float()
            while len(window) or len(rest):
                if not len(window):  # (nothing in flight)
                    window, rest = _next_window(cache, rest, window, size)
                    if not len(window):  # the pool's reserve for one token was broken: a bug
                        raise RuntimeError(
                            f"{cache.experts.name}: no room for one expert to stream"
                        )
                    pending = _request(loader, window, window, stats)
                following, rest = _next_window(cache, rest, window, size)
                pending = np.concatenate([pending, _request(loader, following, window, stats)])
                loader.land(window, stats, call.num_tokens)
                cache.in_use[window] = False
                rows, ks = np.nonzero(np.isin(ids, window) & ~held)
                weights = call.topk_weights[upload(rows, device), upload(ks, device)][:, None]
                part = call.rows(rows, weights, ids[rows, ks][:, None])
                launched = kernel_launch.launch(loader, part, window).float()
                total.index_add_(0, upload(row_of[rows], device), launched)
                pending, window = following, following
            out[upload(split, device)] = total.to(out.dtype)
        finally:
            cache.in_use[pending] = False
        return out


def stream_window(cache: ExpertCache) -> int:
    """Experts a window reads: a token's ``top_k``, at most half the pool. The fewer
    slots stream, the more the pool keeps for the next call; one window read while the
    one before computes keeps the disk busy (its reads take longer than a window's
    launch), at ``top_k`` experts' tensors in its queue."""
    return max(1, min(cache.top_k, cache.capacity() // 2))


def _next_window(
    cache: ExpertCache, rest: np.ndarray, busy: np.ndarray, size: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(window, rest)``: the longest prefix of ``rest``, at most ``size`` experts, that
    fits in the pool beside ``busy`` (experts a launch still needs)."""
    room = min(cache.capacity() - len(busy), size)
    take = max(0, min(len(rest), room))
    while take and not cache.capacity_for(np.union1d(busy, rest[:take])):
        take -= 1
    return rest[:take], rest[take:]


def _request(
    loader: ExpertLoader, window: np.ndarray, busy: np.ndarray, stats: PhaseStats
) -> np.ndarray:
    """Queue ``window``'s reads, evicting none of ``busy``; the window is in use until it
    is launched (a hook's loads, other layers' in a shared pool, must not take it)."""
    if len(window):
        demand = loader.cache.policy.sweep_demand()
        loader.request(window, stats, np.union1d(busy, window), demand, ahead=True)
        loader.cache.in_use[window] = True
    return window
