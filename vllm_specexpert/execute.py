"""The executor: runs one layer call under any miss policy's plan. The one place that
carries out a plan over the device and the layer's places.

A call is one :class:`LayerCall` (the tokens, their routing on the device and on the
host, the layer's kernel, the counters of the call's phase). :func:`resolve` surveys
it (:func:`~vllm_specexpert.device_runs.one_launch.survey`) and asks the miss policy for
a plan only when entries are missing (:mod:`vllm_specexpert.policy`); :func:`execute`
carries out the plan, top to bottom:
its :class:`Split` (which entries each place takes, counted; the weights to run), the
other places' entries staged, the device entries through the layer's device run
(:mod:`vllm_specexpert.device_runs`, chosen when the layer was composed) with the other
entries masked out (weight 0), each place's results added, an expert admitted. Without a
plan every entry runs on the device, loaded on demand
(:meth:`~vllm_specexpert.device_runs.one_launch.OneLaunch.run_all`: the bit-exact path,
which ``fetch`` and every prefill pass take without coming here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from vllm_specexpert.device_runs.one_launch import OneLaunch, Survey, survey
from vllm_specexpert.handback import UnreadableRows
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.places import Dropped, Place, Places
from vllm_specexpert.policy import MissContext, MissPlan, MissPolicy
from vllm_specexpert.stats import PhaseStats
from vllm_specexpert.tiers.loader import ExpertLoader
from vllm_specexpert.tiers.staging import upload
from vllm_specexpert.tiers.store import ExpertsUnreadable


def resolve(
    device: OneLaunch,
    loader: ExpertLoader,
    call: LayerCall,
    policy: MissPolicy,
    context: MissContext,
) -> torch.Tensor:
    """A decode call: survey it, ask ``policy`` about its missing entries, run the plan
    (its device entries through ``device``, the layer's device run)."""
    found = survey(loader, call, policy.spec.waits_for_copies)
    plan = (
        policy.plan(call.host_ids, found.resident, call.topk_weights, context)
        if found.missed
        else None
    )
    if plan is None:  # (every entry on the device, missing ones loaded on demand)
        return device.run_all(loader, call, found)
    return execute(device, loader, call, found, plan, context.places, context.admit_host_experts)


def execute(
    device: OneLaunch,
    loader: ExpertLoader,
    call: LayerCall,
    found: Survey,
    plan: MissPlan,
    places: Places,
    admit: bool = False,
) -> torch.Tensor:
    """Routed-expert output of the call under ``plan``: the entries of the other
    ``places`` start first, the device's run, then each place adds its results, in the
    registry's order; entries a place could not compute run on the device, loaded.
    ``admit``: then load the most used expert a place that ``admits`` computed, on an
    idle link."""
    split = Split.of(plan, places, call.host_ids, found, call.stats)
    planned = call.routed(split.weights(call, plan), plan.topk_ids)
    jobs = [(place, place.stage(planned, entries)) for place, entries in split.elsewhere]
    out = _launch(device, loader, planned, split.on_device)
    for place, job in jobs:
        failed = place.finish(job, out)
        if failed is not None and failed.any():  # (a peer that left the rotation)
            call.stats.fetched_entries += int(np.count_nonzero(failed))
            index, part = planned.masked(failed)
            out[index] += device.run(loader, part, np.unique(part.host_ids))
    if admit:
        _admit(loader, call.host_ids, split, call.stats)
    return out


@dataclass
class Split:
    """Where a plan's entries run: each place's, and the device's (the router's or a
    substitute's expert, loaded if missing)."""

    chosen: list[tuple[Place, np.ndarray]]
    """The places the plan gives entries to, in the registry's order, with them."""
    elsewhere: list[tuple[Place, np.ndarray]]
    """Of those, the places off the device that have some."""
    on_device: np.ndarray
    """``[T, K]`` entries in the device's launch."""

    @classmethod
    def of(
        cls, plan: MissPlan, places: Places, ids: np.ndarray, found: Survey, stats: PhaseStats
    ) -> Split:
        """The split of ``plan`` over the call's ``ids``, its entries counted: each
        place's, the fetched ones, and the missing experts no device entry loads
        (requested and missed all the same)."""
        places.count(plan.places, stats)
        chosen = [(place, plan.places[place.name]) for place in places if place.name in plan.places]
        on_device = np.ones(ids.shape, dtype=bool)
        replaced = np.zeros(ids.shape, dtype=bool)
        for place, entries in chosen:
            if place.on_device:
                replaced |= entries
            else:
                on_device &= ~entries
        fetched = found.missing & on_device & ~replaced
        stats.fetched_entries += int(np.count_nonzero(fetched))
        unloaded = np.setdiff1d(ids[found.missing & ~fetched], plan.topk_ids[on_device])
        stats.requests += len(unloaded)
        stats.misses += len(unloaded)
        elsewhere = [(place, e) for place, e in chosen if not place.on_device and e.any()]
        return cls(chosen, elsewhere, on_device)

    def weights(self, call: LayerCall, plan: MissPlan) -> torch.Tensor:
        """The routed weights to run: as routed, or, where the plan renormalises, scaled
        per token over the entries that are computed, wherever they run."""
        weights = call.topk_weights
        if not plan.renormalize:
            return weights
        running = np.ones(self.on_device.shape, dtype=bool)
        for place, entries in self.chosen:
            if not place.computes:
                running &= ~entries
        kept = torch.where(upload(running, call.x.device), weights, 0.0).sum(-1, keepdim=True)
        return weights * (weights.sum(-1, keepdim=True) / kept.clamp_min(1e-20))


def _launch(
    device: OneLaunch, loader: ExpertLoader, planned: LayerCall, on_device: np.ndarray
) -> torch.Tensor:
    """The device's entries of ``planned`` through its run; the others' rows zero."""
    if on_device.all():
        return device.run(loader, planned, np.unique(planned.host_ids))
    out = torch.zeros_like(planned.x)
    if on_device.any():
        index, part = planned.masked(on_device)
        out[index] = device.run(loader, part, np.unique(part.host_ids))
    elif planned.first_launch.pending:  # (no launch: its work starts all the same)
        loader.begin_run(np.zeros(0, dtype=np.int64), planned.stats)
        planned.first_launch.run()
    return out


def _admit(loader: ExpertLoader, ids: np.ndarray, split: Split, stats: PhaseStats) -> None:
    """Load the expert a place that ``admits`` computed for the most entries."""
    admitted = [entries for place, entries in split.elsewhere if place.admits]
    if admitted:
        computed = np.logical_or.reduce(admitted)
        experts, counts = np.unique(ids[computed], return_counts=True)
        loader.admit(int(experts[np.argmax(counts)]), stats)


RETRY_COUNTERS = ("loads", "bytes_loaded", "evictions")
"""What a call run again counts in its phase: its copies (each is a read of the slow
tier); the call itself was counted once already."""


def execute_without(
    device: OneLaunch,
    loader: ExpertLoader,
    call: LayerCall,
    error: ExpertsUnreadable,
    rows: UnreadableRows,
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
            out = execute(device, loader, again, survey(loader, again), plan, Places())
        except ExpertsUnreadable as more:
            error = more
            continue
        finally:
            for name in RETRY_COUNTERS:
                setattr(call.stats, name, getattr(call.stats, name) + getattr(again.stats, name))
        rows.add(np.flatnonzero(dropped.any(axis=1)).tolist())
        return out
