"""A step's predicted demand (the path predictor's, or the lookahead draft's routes) as an
engine feature: each decode call scores it against the router's choice (the stats'
``path_*`` counters) and, under ``cache: plec``, the planner keeps the shared pool by it
(:class:`~vllm_specexpert.planner.plec.PlecPlanner`)."""

from __future__ import annotations

from collections.abc import Callable

from vllm_specexpert.features.base import DecodeCall, EngineFeature
from vllm_specexpert.handoff import StepDemand
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.planner.plec import PlecPlanner


class StepDemandFeature(EngineFeature):
    name = "step_demand"

    def __init__(
        self,
        demand: Callable[[], StepDemand | None],
        layers: Callable[[], list[OffloadedLayer]],
        planner: PlecPlanner | None,
    ):
        self.demand = demand
        """The running step's demand (set per layer call by the vLLM adapter)."""
        self.layers = layers
        self.planner = planner
        self._scored: StepDemand | None = None
        """The demand of the running call, once scored."""

    def after_read(self, call: DecodeCall) -> None:
        demand = self.demand()
        self._scored = demand and demand.scored(call.layer.index, call.router_host_ids, call.stats)
        if self._scored is not None and self.planner is not None:
            self.planner.before_layer(self._scored, call.layer, self.layers())

    def end_call(self, call: DecodeCall) -> None:
        if self._scored is not None and self.planner is not None:
            self.planner.after_layer(self._scored, call.layer)
        self._scored = None
