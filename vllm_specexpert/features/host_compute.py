"""``cpu``, ``auto`` and ``auto_buddy``: compute missing experts on the host.

``cpu``: every missing expert on the host. ``auto``: the link and the host work in
parallel, so a call waits ``max(link time, host time)``; the ``j`` cheapest host experts
go to the host, ``j`` minimising ``max(sum of their host times, (m - j) *
copy_seconds)``; ties go to fetching (the expert stays resident). ``auto_buddy``:
buddies first where BuddyMoE's gates allow (:mod:`.substitution`), then the same split.

The mode in one module: each layer's place :class:`HostPlace`, which computes its
entries from the slow tier while the device runs its own, its counters, the policies
built with it, and the feature that registers it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.config.modes import MISS_POLICIES
from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.features.substitution import SubstitutedPlace, substitution_plan
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.places import Place, PlaceCounters, Places
from vllm_specexpert.policy import MissContext, MissPlan, MissPolicy, PlacedPolicy
from vllm_specexpert.stats import counter, seconds
from vllm_specexpert.tiers.host import HostExperts
from vllm_specexpert.tiers.store import LayerExperts


@dataclass
class HostCounters(PlaceCounters):
    entries_field = "host_entries"
    host_entries: int = counter(
        "Missed entries computed on the host from the slow tier (``cpu``, ``auto``)."
    )
    host_experts: int = counter("Distinct experts computed on the host, summed over layer calls.")
    host_s: float = seconds(
        "Seconds of host expert compute (modeled seconds with an emulated link: "
        "measured time x ``link.host_slowdown``)."
    )
    host_stall_s: float = seconds(
        "Seconds layer calls waited for the host after their device work was done."
    )


class HostPlace(Place):
    """Entries computed on the host from the slow tier, while the device runs its own."""

    name = "host"
    counters = HostCounters
    admits = True

    def __init__(self, host: HostExperts):
        self.host = host

    def estimate(self, rows: np.ndarray) -> np.ndarray:
        return self.host.estimate(rows)

    def stage(self, call: LayerCall, entries: np.ndarray) -> tuple[LayerCall, Any, float]:
        staged = self.host.stage(call.x, call.topk_weights, call.host_ids, entries)
        return call, staged, time.perf_counter()

    def finish(self, job: tuple[LayerCall, Any, float], out: torch.Tensor) -> None:
        call, staged, started_at = job
        charged, waited = self.host.finish(staged, out, started_at)
        counters = call.stats.part(HostCounters)
        counters.host_experts += staged.experts
        counters.host_s += charged
        counters.host_stall_s += waited
        return None


class HostCosts(Protocol):
    def estimate(self, rows: np.ndarray) -> np.ndarray:
        """Host seconds of each expert for ``rows`` tokens each."""
        ...


def host_share(
    ids: np.ndarray, missing: np.ndarray, host: HostCosts, copy_seconds: float
) -> np.ndarray:
    """``[T, K]`` mask of the missing entries the host should compute."""
    experts, rows = np.unique(ids[missing], return_counts=True)
    host_s = host.estimate(rows)
    order = np.argsort(host_s, kind="stable")
    host_time = np.concatenate([[0.0], np.cumsum(host_s[order])])
    link_time = (len(experts) - np.arange(len(experts) + 1)) * copy_seconds
    best = int(np.argmin(np.maximum(host_time, link_time)))  # first minimum: fewest on host
    return missing & np.isin(ids, experts[order[:best]])


class CpuPolicy(PlacedPolicy):
    spec = MISS_POLICIES["cpu"]
    place_kind = HostPlace
    place: HostPlace

    def plan(
        self,
        ids: np.ndarray,
        resident: np.ndarray,
        topk_weights: torch.Tensor,
        context: MissContext,
    ) -> MissPlan | None:
        return MissPlan(topk_ids=ids, places={HostPlace.name: ~resident[ids]})


class AutoPolicy(MissPolicy):
    spec = MISS_POLICIES["auto"]

    def __init__(self, host: HostPlace, substitutes: SubstitutedPlace | None = None) -> None:
        self.host = host
        self.substitutes = substitutes
        """Where buddies run first (``auto_buddy``)."""

    @classmethod
    def for_layer(cls, places: Places) -> MissPolicy:
        substitutes = places.of(SubstitutedPlace) if cls.spec.substitutes else None
        return cls(places.of(HostPlace), substitutes)

    def plan(
        self,
        ids: np.ndarray,
        resident: np.ndarray,
        topk_weights: torch.Tensor,
        context: MissContext,
    ) -> MissPlan | None:
        plan = MissPlan(topk_ids=ids)
        if self.substitutes is not None:
            plan = substitution_plan(ids, resident, topk_weights, self.substitutes)
        missing = ~resident[plan.topk_ids]
        if missing.any():
            on_host = host_share(plan.topk_ids, missing, self.host, context.copy_seconds)
            if on_host.any():
                plan.places[HostPlace.name] = on_host
        if SubstitutedPlace.name not in plan.places and HostPlace.name not in plan.places:
            return None  # fetch everything: the exact path
        return plan


class AutoBuddyPolicy(AutoPolicy):
    spec = MISS_POLICIES["auto_buddy"]


class HostComputeFeature(EngineFeature):
    name = "host_compute"

    def __init__(self, parts: EngineParts):
        link = parts.config.link
        self.slowdown = link.host_slowdown if link.emulated else None

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        return cls(parts) if parts.config.miss_policy_spec.computes_on_host else None

    @classmethod
    def check(cls, parts: EngineParts, inputs: Inputs) -> None:
        policy = parts.config.miss_policy_spec
        if policy.computes_on_host and any(
            layer.host_kernel is None for layer in parts.layers.values()
        ):
            raise SpecExpertConfigError(
                "miss_policy",
                f"'{policy.name}' computes experts on the host, and this "
                "model's expert layers have no host kernel",
                "use 'fetch' (this layer type cannot compute experts on the host)",
            )

    def equip(self, layer: OffloadedLayer) -> None:
        # Host compute reads the experts where they are: in host memory.
        if layer.host_kernel is not None and isinstance(layer.experts, LayerExperts):
            host = HostExperts(layer.experts, layer.host_kernel, self.slowdown)
            layer.add_place(HostPlace(host))

    def unequip(self, layer: OffloadedLayer) -> None:
        layer.places.unregister(HostPlace.name)


POLICIES = (CpuPolicy, AutoPolicy, AutoBuddyPolicy)
FEATURE = HostComputeFeature
