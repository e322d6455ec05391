"""A call whose experts do not fit the pool, exactly: whole tokens in groups whose
experts fit, each group one launch. Exact because the fused-experts kernel computes each
token independently of the others in its launch (checked bit for bit for vLLM's CPU
kernel in ``tests/test_kernel_exactness.py``): only *which* tokens share a launch
changes, never a token's arithmetic. An expert two groups need is read once per group."""

from __future__ import annotations

import numpy as np
import torch

from vllm_specexpert.device_runs import kernel_launch
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.tiers.cache import ExpertCache
from vllm_specexpert.tiers.loader import ExpertLoader
from vllm_specexpert.tiers.staging import upload

GROUP_SCAN_FACTOR = 4
"""A token group is grown from at most ``GROUP_SCAN_FACTOR * slots`` candidate tokens
per round, bounding the host work of planning."""


class TokenGroups:
    """What does not fit runs in token groups (``fetch``: exact)."""

    def run(self, loader: ExpertLoader, call: LayerCall) -> torch.Tensor:
        cache, ids, stats = loader.cache, call.host_ids, call.stats
        out = torch.empty_like(call.x)
        remaining = np.arange(ids.shape[0])
        while remaining.size:
            group = next_token_group(cache, ids, remaining)
            if not len(group):  # the pool's reserve for one token was broken: a bug
                raise RuntimeError(f"{cache.experts.name}: no room for one token's experts")
            experts = np.unique(ids[group])
            rest = np.setdiff1d(remaining, group, assume_unique=True)
            demand = np.bincount(ids[rest].ravel(), minlength=cache.num_experts)
            loader.acquire(experts, stats, future_demand=demand, tokens=len(group))
            # Every remaining token whose experts are now all resident joins the launch.
            resident = cache.resident_mask()
            ready = remaining[resident[ids[remaining]].all(axis=1)]
            hits = np.setdiff1d(np.unique(ids[ready]), experts)
            loader.acquire(hits, stats, tokens=len(ready))  # (hits only)
            part = call.rows(ready)
            launched = kernel_launch.launch(loader, part, np.unique(ids[ready]))
            out[upload(ready, call.x.device)] = launched
            remaining = np.setdiff1d(remaining, ready, assume_unique=True)
        return out


def next_token_group(cache: ExpertCache, ids: np.ndarray, remaining: np.ndarray) -> np.ndarray:
    """Tokens (indices into ``ids``) whose experts fit in the pool together: candidates
    sorted by fewest non-resident experts, and the longest prefix of them whose union of
    experts needing a non-pinned slot fits. Vectorized: each expert's first position in
    that order gives, by a cumulative count, the union size of every prefix. Never
    empty: a single token always fits (slots >= top_k, and pinned experts leave top_k
    slots free). The caller then adds every token the loaded experts cover."""
    resident = cache.resident_mask()
    pinned_resident = cache.policy.pinned & resident
    capacity = cache.capacity()
    missing = (~resident[ids[remaining]]).sum(axis=1)
    candidates = remaining[np.argsort(missing, kind="stable")][: GROUP_SCAN_FACTOR * capacity]
    experts = ids[candidates]  # [C, K]
    position = np.broadcast_to(np.arange(len(candidates))[:, None], experts.shape)
    counted = ~pinned_resident[experts]
    first = np.full(cache.num_experts, len(candidates), dtype=np.int64)
    np.minimum.at(first, experts[counted], position[counted])
    growth = np.bincount(first[first < len(candidates)], minlength=len(candidates)).cumsum()
    take = max(int(np.searchsorted(growth, capacity, side="right")), 1)
    return candidates[:take]
