"""Substitution (``buddy``, ``random``; with host compute, ``auto_buddy``): run a resident
expert in place of a missing one, behind BuddyMoE's gates
(:mod:`vllm_specexpert.policy.buddies`); missing entries that no substitute qualifies for
are fetched. ``random`` is the paper's baseline: any resident expert instead of a
co-activated buddy, same gates.

The mode in one module: each layer's place :class:`SubstitutedPlace` (BuddyMoE's gates
and, from the calibration's routing statistics (co-activation counts, TAE percentiles),
the buddy lists and a percentile tau), its counters, the policies built with it, and the
feature that registers it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.config.modes import MISS_POLICIES
from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.places import Place, PlaceCounters
from vllm_specexpert.policy import MissContext, MissPlan, PlacedPolicy
from vllm_specexpert.policy.buddies import (
    BuddyGates,
    buddy_lists,
    substitute,
    token_activating_entropy,
)
from vllm_specexpert.stats import counter

RoutingStatistics = dict[str, tuple[np.ndarray, np.ndarray]]
"""Layer name -> its ``[E, E]`` co-activation counts and ``[101]`` TAE percentiles."""


@dataclass
class SubstitutedCounters(PlaceCounters):
    entries_field = "substituted_entries"
    substituted_entries: int = counter(
        "Missed entries run with a resident substitute instead (``buddy``, "
        "``random``, ``auto_buddy``; output not exact)."
    )


class SubstitutedPlace(Place):
    """Entries run on the device with a resident substitute's id in the plan."""

    name = "substituted"
    counters = SubstitutedCounters
    on_device = True

    def __init__(self, buddies: np.ndarray | None, gates: BuddyGates | None):
        self.buddies = buddies
        """``[E, K_max]`` buddy lists, best first, -1 padded (``None``: any resident)."""
        self.gates = gates
        """The gates with this layer's tau (``None`` until the calibration gives it)."""
        self.rng = np.random.default_rng(0)
        """Randomness of the ``random`` baseline (seeded: runs are repeatable)."""


def substitution_plan(
    ids: np.ndarray,
    resident: np.ndarray,
    topk_weights: torch.Tensor,
    place: SubstitutedPlace,
    use_buddies: bool = True,
) -> MissPlan:
    """Entries substituted where the gates allow; the rest stay as routed."""
    assert place.gates is not None, "a substituting policy's layer has its gates"
    tae = token_activating_entropy(topk_weights).cpu().numpy()
    new_ids, replaced = substitute(
        ids,
        resident,
        place.buddies if use_buddies else None,
        tae,
        place.gates,
        rng=None if use_buddies else place.rng,
    )
    return MissPlan(topk_ids=new_ids, places={SubstitutedPlace.name: replaced})


class BuddyPolicy(PlacedPolicy):
    spec = MISS_POLICIES["buddy"]
    place_kind = SubstitutedPlace
    place: SubstitutedPlace
    use_buddies = True

    def plan(
        self,
        ids: np.ndarray,
        resident: np.ndarray,
        topk_weights: torch.Tensor,
        context: MissContext,
    ) -> MissPlan:
        return substitution_plan(ids, resident, topk_weights, self.place, self.use_buddies)


class RandomPolicy(BuddyPolicy):
    spec = MISS_POLICIES["random"]
    use_buddies = False


class SubstitutionFeature(EngineFeature):
    name = "substitution"
    inputs = ("routing_statistics",)

    def __init__(self, config: SpecExpertConfig, statistics: RoutingStatistics | None):
        self.config = config
        self.statistics = statistics

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        config = parts.config
        statistics = inputs.get("routing_statistics")
        if not config.miss_policy_spec.substitutes:
            return None
        if config.routing_statistics_need is not None and statistics is None:
            return None  # (built again once the adapter provides them; checked at start)
        return cls(config, statistics)

    @classmethod
    def check(cls, parts: EngineParts, inputs: Inputs) -> None:
        config = parts.config
        statistics = inputs.get("routing_statistics") or {}
        if config.routing_statistics_need is not None and any(
            name not in statistics for name in parts.layers
        ):
            raise SpecExpertConfigError(
                "calibration",
                f"miss_policy '{config.miss_policy}' needs the calibration's "
                "co-activation counts and TAE percentiles, loaded at engine start",
                "start the engine with 'calibration' set to a directory from "
                "`specexpert calibrate` for this model",
            )

    def equip(self, layer: OffloadedLayer) -> None:
        buddy = self.config.buddy
        buddies, tau = None, buddy.tau
        if self.statistics is not None and layer.name in self.statistics:
            coactivation, tae_percentiles = self.statistics[layer.name]
            if self.config.miss_policy_spec.uses_buddy_lists:
                buddies = buddy_lists(np.asarray(coactivation), buddy.alpha, buddy.k_max)
            if tau is None:
                percentiles = np.asarray(tae_percentiles, dtype=np.float64)
                grid = np.linspace(0, 100, 101)
                tau = float(np.interp(buddy.tau_percentile, grid, percentiles))
        gates = None if tau is None else BuddyGates(tau=tau, beta=buddy.beta, rho=buddy.rho)
        layer.add_place(SubstitutedPlace(buddies, gates))

    def unequip(self, layer: OffloadedLayer) -> None:
        layer.places.unregister(SubstitutedPlace.name)


POLICIES = (BuddyPolicy, RandomPolicy)
FEATURE = SubstitutionFeature
