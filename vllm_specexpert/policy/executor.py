"""Running routed entries from the device cache, loading missing experts on demand.

Shared by every miss policy: whatever a policy decides, the entries it leaves on the
device run here. When a batch needs more distinct experts than the pool holds (prefill,
large decode batches at small budgets), it runs in token groups whose experts fit. This
stays exact because the fused-experts kernel computes each token independently of the
others in its batch (checked bit-for-bit for vLLM's CPU kernel in
``tests/test_kernel_exactness.py``): only *which* tokens share a launch changes, never
the arithmetic of a token.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm_specexpert.cache import ExpertCache

ExpertKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor
]
"""``kernel(x, topk_weights, slot_ids, slots) -> out``: the layer's fused-experts kernel
run on the slot tensors ``slots`` (name -> ``[num_slots, ...]``), with router expert ids
already mapped to slot indices."""

GROUP_SCAN_FACTOR = 4
"""A token group is grown from at most ``GROUP_SCAN_FACTOR * slots`` candidate tokens
per round, bounding the host work of planning."""


def run_on_device(
    cache: ExpertCache,
    kernel: ExpertKernel,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    ids: np.ndarray,
    before_kernel: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Output of ``kernel`` for the routing ``topk_ids`` (``ids``: the same on the host),
    loading what is missing. ``before_kernel`` is called once, when the first launch's
    experts are resident and before it starts."""
    needed = np.unique(ids)
    cache.begin_run(needed)
    if cache.capacity_for(needed):
        cache.acquire(needed)
        if before_kernel is not None:
            before_kernel()
        cache.stats.kernel_calls += 1
        return kernel(x, topk_weights, cache.slot_ids(topk_ids, ids), cache.slots)
    out = torch.empty_like(x)
    remaining = np.arange(ids.shape[0])
    while remaining.size:
        group = next_token_group(cache, ids, remaining)
        experts = np.unique(ids[group])
        rest = np.setdiff1d(remaining, group, assume_unique=True)
        demand = np.bincount(ids[rest].ravel(), minlength=cache.num_experts)
        cache.acquire(experts, future_demand=demand)
        # Every remaining token whose experts are now all resident joins the launch.
        resident = cache.resident_mask()
        ready = remaining[resident[ids[remaining]].all(axis=1)]
        cache.acquire(np.setdiff1d(np.unique(ids[ready]), experts))  # hits only
        if before_kernel is not None:
            before_kernel()
            before_kernel = None
        index = torch.from_numpy(ready).to(x.device)
        out[index] = kernel(
            x[index], topk_weights[index], cache.slot_ids(topk_ids[index], ids[ready]),
            cache.slots,
        )
        cache.stats.kernel_calls += 1
        remaining = np.setdiff1d(remaining, ready, assume_unique=True)
    return out


def next_token_group(cache: ExpertCache, ids: np.ndarray, remaining: np.ndarray) -> np.ndarray:
    """Tokens (indices into ``ids``) whose experts fit in the pool together, chosen
    greedily by fewest non-resident experts. Never empty: a single token always fits
    (slots >= top_k, and pinned experts leave top_k slots free)."""
    resident = cache.resident_mask()
    pinned_resident = cache.policy.pinned & resident
    capacity = cache.num_slots - int(pinned_resident.sum())
    missing = (~resident[ids[remaining]]).sum(axis=1)
    candidates = remaining[np.argsort(missing, kind="stable")]
    group: list[int] = []
    chosen: set[int] = set()
    used = 0  # chosen experts that need a non-pinned slot
    for token in candidates[: GROUP_SCAN_FACTOR * cache.num_slots]:
        new = {int(e) for e in ids[token]} - chosen
        extra = sum(1 for e in new if not pinned_resident[e])
        if used + extra <= capacity:
            group.append(int(token))
            chosen |= new
            used += extra
            if used == capacity:
                break
    assert group, "a single token must always fit in the pool"
    return np.asarray(group, dtype=np.int64)
