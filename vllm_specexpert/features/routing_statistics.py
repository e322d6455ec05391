"""The calibration's routing statistics as an engine feature: each layer's co-activation
counts and TAE percentiles become the buddy lists and gates that the substituting miss
policies consult (``buddy``, ``auto_buddy``: :mod:`vllm_specexpert.policy.buddies`)."""

from __future__ import annotations

import numpy as np

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.policy import add_routing_statistics

RoutingStatistics = dict[str, tuple[np.ndarray, np.ndarray]]
"""Layer name -> its ``[E, E]`` co-activation counts and ``[101]`` TAE percentiles."""


class RoutingStatisticsFeature(EngineFeature):
    name = "routing_statistics"
    inputs = ("routing_statistics",)

    def __init__(self, parts: EngineParts, statistics: RoutingStatistics):
        self.config = parts.config
        self.statistics = statistics

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        statistics = inputs.get("routing_statistics")
        if parts.config.routing_statistics_need is None or statistics is None:
            return None
        return cls(parts, statistics)

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
        coactivation, tae_percentiles = self.statistics[layer.name]
        add_routing_statistics(
            layer.miss_context,
            self.config,
            np.asarray(coactivation),
            np.asarray(tae_percentiles, dtype=np.float64),
        )


FEATURE = RoutingStatisticsFeature
