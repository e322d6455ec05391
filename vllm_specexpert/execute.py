"""The executor: runs one layer call under any miss policy's plan. The one place that
launches expert kernels and computes experts on the host.

A call is one :class:`LayerCall` (the tokens, their routing on the device and on the
host, the layer's kernel, the counters of the call's phase). :func:`survey` finds its
missing entries; the engine asks the miss policy for a plan only when there are some
(:mod:`vllm_specexpert.policy`); :func:`run` carries out the plan: the device entries
through :func:`run_on_device` with the other entries masked out (weight 0), the host
entries through :class:`~vllm_specexpert.tiers.host.HostExperts`, then adds the two.
Without a plan every entry runs on the device, loaded on demand: the bit-exact path of
``fetch`` and of every prefill pass.

:func:`run_on_device` runs routed entries from the device cache. When a batch needs more
distinct experts than the pool holds (prefill, large decode batches at small budgets),
it runs in token groups whose experts fit. This stays exact because the fused-experts
kernel computes each token independently of the others in its batch (checked bit for bit
for vLLM's CPU kernel in ``tests/test_kernel_exactness.py``): only *which* tokens share a
launch changes, never the arithmetic of a token.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from vllm_specexpert.config.sizing import KERNEL_CHUNK_TOKENS
from vllm_specexpert.handback import UnreadableRows
from vllm_specexpert.layer_call import UNREAD, ExpertKernel, LayerCall
from vllm_specexpert.places import Dropped, Places
from vllm_specexpert.policy import MissContext, MissPlan, MissPolicy
from vllm_specexpert.stats import PhaseStats
from vllm_specexpert.tiers.cache import ExpertCache, KernelRouting
from vllm_specexpert.tiers.loader import ExpertLoader
from vllm_specexpert.tiers.staging import upload
from vllm_specexpert.tiers.store import ExpertsUnreadable

GROUP_SCAN_FACTOR = 4
"""A token group is grown from at most ``GROUP_SCAN_FACTOR * slots`` candidate tokens
per round, bounding the host work of planning."""


@dataclass
class Survey:
    """What a call's routing finds in the cache."""

    resident: np.ndarray
    """``[E]`` experts that count as resident (landed ones only, for a policy that does
    not wait for copies)."""
    missing: np.ndarray
    """``[T, K]`` entries whose expert is not resident."""
    missed: int
    """How many entries are missing."""
    needed: np.ndarray
    """The call's distinct experts."""


def survey(loader: ExpertLoader, call: LayerCall, waits_for_copies: bool = True) -> Survey:
    """The call's missing entries and distinct experts, counted."""
    resident = loader.cache.resident_mask() if waits_for_copies else loader.ready_mask()
    missing = ~resident[call.host_ids]
    missed = int(np.count_nonzero(missing))
    call.stats.missed_entries += missed
    needed = np.unique(call.host_ids)
    call.stats.experts_needed += len(needed)
    return Survey(resident, missing, missed, needed)


def resolve(
    loader: ExpertLoader, call: LayerCall, policy: MissPolicy, context: MissContext
) -> torch.Tensor:
    """A decode call: survey it, ask ``policy`` about its missing entries, run the plan."""
    found = survey(loader, call, policy.spec.waits_for_copies)
    plan = (
        policy.plan(call.host_ids, found.resident, call.topk_weights, context)
        if found.missed
        else None
    )
    if plan is None:
        return execute(loader, call, found)
    return execute(loader, call, found, plan, context.places, context.admit_host_experts)


def execute(
    loader: ExpertLoader,
    call: LayerCall,
    found: Survey,
    plan: MissPlan | None = None,
    places: Places | None = None,
    admit: bool = False,
) -> torch.Tensor:
    """Routed-expert output of the call under ``plan`` (``None``: every entry on the
    device, missing ones loaded on demand): the entries of the other ``places`` start
    first, the device's run, then each place adds its results, in the registry's order;
    entries a place could not compute run on the device, loaded. ``admit``: then load
    the most used expert a place that ``admits`` computed, on an idle link."""
    if plan is None:
        call.stats.fetched_entries += found.missed
        return run_on_device(loader, call, found)
    assert places is not None  # (a plan's entries go to places)
    ids, stats = call.host_ids, call.stats
    places.count(plan.places, stats)
    chosen = [(place, plan.places[place.name]) for place in places if place.name in plan.places]
    elsewhere = [(place, e) for place, e in chosen if not place.on_device and e.any()]
    on_device = np.ones(ids.shape, dtype=bool)
    replaced = np.zeros(ids.shape, dtype=bool)
    for place, entries in chosen:
        if place.on_device:
            replaced |= entries
        else:
            on_device &= ~entries
    fetched = found.missing & on_device & ~replaced
    stats.fetched_entries += int(np.count_nonzero(fetched))
    # Missing experts that no device entry loads still count as requested and missed.
    unloaded = np.setdiff1d(ids[found.missing & ~fetched], plan.topk_ids[on_device])
    stats.requests += len(unloaded)
    stats.misses += len(unloaded)

    weights = call.topk_weights
    if plan.renormalize:  # over the entries that run, wherever they run
        running = np.ones(ids.shape, dtype=bool)
        for place, entries in chosen:
            if not place.computes:
                running &= ~entries
        kept = torch.where(upload(running, call.x.device), weights, 0.0).sum(-1, keepdim=True)
        weights = weights * (weights.sum(-1, keepdim=True) / kept.clamp_min(1e-20))
    planned = call.routed(weights, plan.topk_ids)
    jobs = [(place, place.stage(planned, entries)) for place, entries in elsewhere]
    if on_device.all():
        out = run_on_device(loader, planned)
    else:
        out = torch.zeros_like(call.x)
        if on_device.any():
            index, part = planned.masked(on_device)
            out[index] = run_on_device(loader, part)
        elif (hook := call.take_before_kernel()) is not None:
            loader.begin_run(np.zeros(0, dtype=np.int64), stats)
            hook()
    for place, job in jobs:
        failed = place.finish(job, out)
        if failed is not None and failed.any():  # (a peer that left the rotation)
            stats.fetched_entries += int(np.count_nonzero(failed))
            index, part = planned.masked(failed)
            part.before_kernel = None
            out[index] += run_on_device(loader, part)
    if admit:
        admitted = [entries for place, entries in elsewhere if place.admits]
        if admitted:
            computed = np.logical_or.reduce(admitted)
            experts, counts = np.unique(ids[computed], return_counts=True)
            loader.admit(int(experts[np.argmax(counts)]), stats)
    return out


RETRY_COUNTERS = ("loads", "bytes_loaded", "evictions")
"""What a call run again counts in its phase: its copies (each is a read of the slow
tier); the call itself was counted once already."""


def execute_without(
    loader: ExpertLoader, call: LayerCall, error: ExpertsUnreadable, rows: UnreadableRows
) -> torch.Tensor:
    """The call again, exactly, with the entries of the experts the slow tier could not
    supply (``error``, and any more that fail while it runs) masked out (weight 0); the
    rows that needed them go to ``rows``, whose requests then fail."""
    unreadable: set[int] = set()
    while True:
        if unreadable.issuperset(error.experts):  # masked out, and still read: a bug
            raise RuntimeError(f"specexpert: {error} again, with them masked out")
        rows.log(error.layer, error.causes)
        unreadable.update(error.experts)
        dropped = np.isin(call.host_ids, sorted(unreadable))
        again = dataclasses.replace(call, stats=PhaseStats())
        plan = MissPlan(call.host_ids, {Dropped.name: dropped})
        try:
            out = execute(loader, again, survey(loader, again), plan, Places())
        except ExpertsUnreadable as more:
            error = more
            continue
        finally:
            for name in RETRY_COUNTERS:
                setattr(call.stats, name, getattr(call.stats, name) + getattr(again.stats, name))
        rows.add(np.flatnonzero(dropped.any(axis=1)).tolist())
        return out


def launch_resident(loader: ExpertLoader, call: LayerCall) -> torch.Tensor:
    """One launch on the call's rows, every expert in the slot of its id
    (``cache.identity``): the router's ids are the slot ids, all hits. Its distinct
    experts are counted (a token's top-k are distinct: nothing is read to the host for
    one token)."""
    stats, ids = call.stats, call.topk_ids
    tokens, top_k = ids.shape
    if tokens == 1:
        distinct = top_k
    else:
        host_ids = call.host_ids if call.host_ids is not UNREAD else ids.cpu().numpy()
        distinct = len(np.unique(host_ids))
    stats.experts_needed += distinct
    stats.requests += distinct
    stats.hits += distinct
    stats.kernel_calls += 1
    if (hook := call.before_kernel) is not None:  # (take_before_kernel, inline: hot)
        call.before_kernel = None
        hook()
    routing = loader.cache.kernel_routing(ids, None)
    started = time.perf_counter()
    out = _kernel(call.kernel, call.x, call.topk_weights, routing)
    stats.kernel_s += time.perf_counter() - started
    return out


def run_on_device(
    loader: ExpertLoader, call: LayerCall, found: Survey | None = None
) -> torch.Tensor:
    """Output of the call's kernel on its routing, loading what is missing. ``found``:
    the call's survey, if the caller has it."""
    cache, stats, ids = loader.cache, call.stats, call.host_ids
    needed = found.needed if found is not None else np.unique(ids)
    loader.begin_run(needed, stats)
    if cache.capacity_for(needed):
        loader.acquire(needed, stats)
        return _launch(loader, call, needed)
    if loader.splits_tokens:
        return run_streamed(loader, call)
    out = torch.empty_like(call.x)
    remaining = np.arange(ids.shape[0])
    while remaining.size:
        group = next_token_group(cache, ids, remaining)
        if not len(group):  # the pool's reserve for one token was broken: a bug
            raise RuntimeError(f"{cache.experts.name}: no room for one token's experts")
        experts = np.unique(ids[group])
        rest = np.setdiff1d(remaining, group, assume_unique=True)
        demand = np.bincount(ids[rest].ravel(), minlength=cache.num_experts)
        loader.acquire(experts, stats, future_demand=demand)
        # Every remaining token whose experts are now all resident joins the launch.
        resident = cache.resident_mask()
        ready = remaining[resident[ids[remaining]].all(axis=1)]
        loader.acquire(np.setdiff1d(np.unique(ids[ready]), experts), stats)  # hits only
        part = call.rows(ready)
        part.before_kernel = call.take_before_kernel()
        out[upload(ready, call.x.device)] = _launch(loader, part, np.unique(ids[ready]))
        remaining = np.setdiff1d(remaining, ready, assume_unique=True)
    return out


def run_streamed(loader: ExpertLoader, call: LayerCall) -> torch.Tensor:
    """A call whose experts do not fit, each missing expert read once: one launch on
    the resident entries (a token whose experts are all resident runs whole: exactly),
    then the missing experts in windows, in id order (the pack's file order), each
    window's entries launched as one-entry tokens. A token split over launches gets the
    kernel's bf16 results added in fp32 and rounded once: equal to the whole token's up
    to rounding (``stream``).

    The reads overlap the compute (the demand is known): a window's reads are queued
    before the launch ahead of it, into slots that launch does not need, so the disk
    reads while the kernel runs. Windows are :func:`stream_window` experts, one
    computing while the next fills; the first takes slots of resident experts this
    call does not need. What a window evicts is the least used of the rest (the
    policy's :meth:`~vllm_specexpert.tiers.eviction.EvictionPolicy.sweep_demand`), so
    the pool keeps, for the next call, the experts used most, and the missing ones
    stream through two windows' slots."""
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
            loader.acquire(resident, stats)  # (hits)
            index, part = call.masked(held)
            part.before_kernel = call.take_before_kernel()
            out[index] = _launch(loader, part, resident)
        split = np.flatnonzero(~held.all(axis=1))
        row_of = np.zeros(len(ids), dtype=np.int64)
        row_of[split] = np.arange(len(split))
        total = out[upload(split, device)].float()
        while len(window) or len(rest):
            if not len(window):  # (nothing in flight)
                window, rest = _next_window(cache, rest, window, size)
                if not len(window):  # the pool's reserve for one token was broken: a bug
                    raise RuntimeError(f"{cache.experts.name}: no room for one expert to stream")
                pending = _request(loader, window, window, stats)
            following, rest = _next_window(cache, rest, window, size)
            pending = np.concatenate([pending, _request(loader, following, window, stats)])
            loader.land(window, stats)
            cache.in_use[window] = False
            rows, ks = np.nonzero(np.isin(ids, window) & ~held)
            weights = call.topk_weights[upload(rows, device), upload(ks, device)][:, None]
            part = call.rows(rows, weights, ids[rows, ks][:, None])
            part.before_kernel = call.take_before_kernel()
            launched = _launch(loader, part, window).float()
            total.index_add_(0, upload(row_of[rows], device), launched)
            pending, window = following, following
        out[upload(split, device)] = total.to(out.dtype)
    finally:
        cache.in_use[pending] = False
    return out


def stream_window(cache: ExpertCache) -> int:
    """Experts a window of :func:`run_streamed` reads: a token's ``top_k``, at most half
    the pool. The fewer slots stream, the more the pool keeps for the next call; one
    window read while the one before computes keeps the disk busy (its reads take
    longer than a window's launch), at ``top_k`` experts' tensors in its queue."""
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


def _launch(loader: ExpertLoader, call: LayerCall, experts: np.ndarray) -> torch.Tensor:
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
    out = _kernel(call.kernel, call.x, call.topk_weights, routing)
    cache.pool.confirm(routing.ids)  # (a mapped pack's pages: unwritten while it ran)
    call.stats.kernel_s += time.perf_counter() - readable
    loader.kernel_launched(experts)
    call.stats.kernel_calls += 1
    return out


def _kernel(
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
