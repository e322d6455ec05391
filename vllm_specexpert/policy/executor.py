"""The plan executor: carries out any miss policy's decision for one layer call.

:func:`run_layer_call` asks the policy for a plan (:mod:`vllm_specexpert.policy.base`)
and executes it: the device entries through :func:`run_on_device` with the other
entries masked out (weight 0), the host entries through :class:`HostExperts`, then adds
the two. Without a plan every entry runs on the device, loaded on demand: the bit-exact
path of ``fetch`` and of every prefill pass.

:func:`run_on_device` runs routed entries from the device cache. When a batch needs more
distinct experts than the pool holds (prefill, large decode batches at small budgets),
it runs in token groups whose experts fit. This stays exact because the fused-experts
kernel computes each token independently of the others in its batch (checked bit for bit
for vLLM's CPU kernel in ``tests/test_kernel_exactness.py``): only *which* tokens share a
launch changes, never the arithmetic of a token.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from vllm_specexpert.cache import ExpertCache
from vllm_specexpert.loader import ExpertLoader
from vllm_specexpert.policy.base import MissContext, MissPlan, MissPolicy
from vllm_specexpert.staging import upload

ExpertKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None],
    torch.Tensor,
]
"""``kernel(x, topk_weights, ids, slots, expert_map) -> out``: the layer's fused-experts
kernel run on the slot tensors ``slots`` (name -> ``[num_slots, ...]``). ``ids`` are slot
indices when ``expert_map`` is ``None``, else router expert ids that the kernel maps
through ``expert_map`` (id -> slot, -1: not resident), as vLLM's fused MoE does for
expert parallelism (see :meth:`ExpertCache.kernel_routing`)."""

GROUP_SCAN_FACTOR = 4
"""A token group is grown from at most ``GROUP_SCAN_FACTOR * slots`` candidate tokens
per round, bounding the host work of planning."""


def run_layer_call(
    policy: MissPolicy,
    loader: ExpertLoader,
    kernel: ExpertKernel,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    before_kernel: Callable[[], None] | None = None,
    context: MissContext | None = None,
    ids: np.ndarray | None = None,
) -> torch.Tensor:
    """Routed-expert output for ``x`` ([tokens, hidden]) under ``policy``. Without
    ``context`` (prefill tokens) every entry runs on the device, loaded on demand.
    ``before_kernel`` is called once, when the first device launch's experts are
    resident and before it starts (the engine issues the next layer's prefetch there,
    so the copy overlaps this layer's expert compute). ``ids``: ``topk_ids`` already
    read to the host by the caller."""
    stats = loader.stats
    if ids is None:
        # On CUDA this is the host sync that on-demand loading cannot avoid: which
        # experts to copy is only known once the router has run.
        ids = topk_ids.cpu().numpy()
    if context is None or policy.waits_for_copies:
        missing = loader.cache.expert_slot[ids] < 0
    else:
        missing = ~loader.ready_mask()[ids]
    missed = int(np.count_nonzero(missing))
    stats.missed_entries += missed
    # The call's distinct experts: computed once, counted, and reused by the fetch path.
    needed = np.unique(ids) if ids.shape[0] > 1 else None
    stats.experts_needed += ids.shape[1] if needed is None else len(needed)
    if context is not None and missed:
        resident = (loader.cache.resident_mask() if policy.waits_for_copies
                    else loader.ready_mask())
        plan = policy.plan(ids, resident, topk_weights, context)
        if plan is not None:
            return _execute_plan(loader, kernel, x, topk_weights, topk_ids, ids, missing,
                                 plan, before_kernel, context)
    stats.fetched_entries += missed
    return run_on_device(loader, kernel, x, topk_weights, topk_ids, ids, before_kernel, needed)


def _execute_plan(
    loader: ExpertLoader,
    kernel: ExpertKernel,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    ids: np.ndarray,
    missing: np.ndarray,
    plan: MissPlan,
    before_kernel: Callable[[], None] | None,
    context: MissContext,
) -> torch.Tensor:
    none = np.zeros(ids.shape, dtype=bool)
    substituted = plan.substituted if plan.substituted is not None else none
    on_host = plan.on_host if plan.on_host is not None else none
    dropped = plan.dropped if plan.dropped is not None else none
    on_device = ~(on_host | dropped)
    stats = loader.stats
    stats.substituted_entries += int(np.count_nonzero(substituted))
    stats.host_entries += int(np.count_nonzero(on_host))
    stats.dropped_entries += int(np.count_nonzero(dropped))
    fetched = missing & on_device & ~substituted
    stats.fetched_entries += int(np.count_nonzero(fetched))
    # Missing experts that no device entry loads still count as requested and missed.
    unloaded = np.setdiff1d(ids[missing & ~fetched], plan.topk_ids[on_device])
    stats.requests += len(unloaded)
    stats.misses += len(unloaded)

    weights = topk_weights
    device_mask = upload(on_device, x.device)
    if plan.renormalize:
        kept = torch.where(device_mask, weights, 0.0).sum(-1, keepdim=True)
        weights = weights * (weights.sum(-1, keepdim=True) / kept.clamp_min(1e-20))
    started_at = time.perf_counter()
    host_job = context.host.stage(x, topk_weights, ids, on_host) if on_host.any() else None
    if on_device.all():
        new_ids = upload(plan.topk_ids, x.device).to(topk_ids.dtype)
        out = run_on_device(loader, kernel, x, weights, new_ids, plan.topk_ids, before_kernel)
    else:
        # Masked entries point at one of their token's device experts, weight 0: the
        # kernel has a fixed top-k, and adding 0 changes nothing.
        rows = np.flatnonzero(on_device.any(axis=1))
        mask = on_device[rows]
        first = plan.topk_ids[rows, mask.argmax(axis=1)]
        device_ids = np.where(mask, plan.topk_ids[rows], first[:, None])
        out = torch.zeros_like(x)
        if len(rows):
            index = upload(rows, x.device)
            out[index] = run_on_device(
                loader, kernel, x[index],
                torch.where(device_mask[index], weights[index], 0.0),
                upload(device_ids, x.device).to(topk_ids.dtype),
                device_ids, before_kernel,
            )
        elif before_kernel is not None:
            loader.begin_run(np.zeros(0, dtype=np.int64))
            before_kernel()
    if host_job is not None:
        charged, waited = context.host.finish(host_job, out, started_at)
        stats.host_experts += host_job.experts
        stats.host_s += charged
        stats.host_stall_s += waited
        if context.admit_host_experts:
            experts, counts = np.unique(ids[on_host], return_counts=True)
            loader.admit(int(experts[np.argmax(counts)]))
    return out


def run_on_device(
    loader: ExpertLoader,
    kernel: ExpertKernel,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    ids: np.ndarray,
    before_kernel: Callable[[], None] | None = None,
    needed: np.ndarray | None = None,
) -> torch.Tensor:
    """Output of ``kernel`` for the routing ``topk_ids`` (``ids``: the same on the host),
    loading what is missing. ``before_kernel`` is called once, when the first launch's
    experts are resident and before it starts. ``needed``: ``np.unique(ids)`` if the
    caller has it."""
    cache, stats = loader.cache, loader.stats
    if ids.shape[0] == 1 and not loader.in_flight and not loader.prefetches:
        # One token whose experts are all resident and landed (batch-1 decode hits):
        # what the general path below does, without its set operations.
        experts = ids[0]
        if cache.expert_slot[experts].min() >= 0 and len(set(experts.tolist())) == len(experts):
            stats.requests += len(experts)
            stats.hits += len(experts)
            cache.touch(experts)
            if before_kernel is not None:
                before_kernel()
            return _launch(loader, kernel, x, topk_weights, topk_ids, ids, experts)
    if needed is None:
        needed = np.unique(ids)
    loader.begin_run(needed)
    if cache.capacity_for(needed):
        loader.acquire(needed)
        if before_kernel is not None:
            before_kernel()
        return _launch(loader, kernel, x, topk_weights, topk_ids, ids, needed)
    out = torch.empty_like(x)
    remaining = np.arange(ids.shape[0])
    while remaining.size:
        group = next_token_group(cache, ids, remaining)
        experts = np.unique(ids[group])
        rest = np.setdiff1d(remaining, group, assume_unique=True)
        demand = np.bincount(ids[rest].ravel(), minlength=cache.num_experts)
        loader.acquire(experts, future_demand=demand)
        # Every remaining token whose experts are now all resident joins the launch.
        resident = cache.resident_mask()
        ready = remaining[resident[ids[remaining]].all(axis=1)]
        loader.acquire(np.setdiff1d(np.unique(ids[ready]), experts))  # hits only
        if before_kernel is not None:
            before_kernel()
            before_kernel = None
        index = upload(ready, x.device)
        out[index] = _launch(loader, kernel, x[index], topk_weights[index], topk_ids[index],
                             ids[ready], np.unique(ids[ready]))
        remaining = np.setdiff1d(remaining, ready, assume_unique=True)
    return out


def _launch(loader: ExpertLoader, kernel: ExpertKernel, x: torch.Tensor,
            topk_weights: torch.Tensor, topk_ids: torch.Tensor, ids: np.ndarray,
            experts: np.ndarray) -> torch.Tensor:
    """One kernel launch on resident ``experts`` (those of ``ids``)."""
    cache = loader.cache
    kernel_ids, expert_map = cache.kernel_routing(topk_ids, ids)
    out = kernel(x, topk_weights, kernel_ids, cache.slots, expert_map)
    loader.kernel_launched(experts)
    loader.stats.kernel_calls += 1
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
    experts = ids[candidates]                                   # [C, K]
    position = np.broadcast_to(np.arange(len(candidates))[:, None], experts.shape)
    counted = ~pinned_resident[experts]
    first = np.full(cache.num_experts, len(candidates), dtype=np.int64)
    np.minimum.at(first, experts[counted], position[counted])
    growth = np.bincount(first[first < len(candidates)], minlength=len(candidates)).cumsum()
    take = max(int(np.searchsorted(growth, capacity, side="right")), 1)
    return candidates[:take]
