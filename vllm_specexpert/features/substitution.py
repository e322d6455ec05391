"""Substitution as an engine feature (``buddy``, ``random``, ``auto_buddy``): each layer's
place :data:`~vllm_specexpert.policy.substitute.SUBSTITUTED`, holding what the policies
consult (:class:`~vllm_specexpert.policy.substitute.Substitutes`): BuddyMoE's gates and,
from the calibration's routing statistics (co-activation counts, TAE percentiles), the
buddy lists and a percentile tau."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.places import Place, PlaceCounters
from vllm_specexpert.policy.buddies import BuddyGates, buddy_lists
from vllm_specexpert.policy.substitute import SUBSTITUTED
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

    name = SUBSTITUTED
    counters = SubstitutedCounters
    on_device = True

    def __init__(self, buddies: np.ndarray | None, gates: BuddyGates | None):
        self.buddies = buddies
        self.gates = gates
        self.rng = np.random.default_rng(0)  # (the ``random`` baseline: repeatable)


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
        layer.places.unregister(SUBSTITUTED)


FEATURE = SubstitutionFeature
