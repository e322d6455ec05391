"""A step's predicted demand (the path predictor's, or the lookahead draft's routes) as an
engine feature: each decode call scores it against the router's choice (the stats'
``path_*`` counters) and, under ``cache: plec``, the planner keeps the shared pools by it
(:class:`~vllm_specexpert.planner.plec.PlecPlanner`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.handoff import DemandCounters, StepDemand
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.pipeline import DecodeCall, Stage
from vllm_specexpert.planner.plec import PlecPlanner


class StepDemandFeature(EngineFeature):
    name = "step_demand"
    inputs = ("step_demand", "draft")
    """The scheduler's demand of the running step; with a draft, the lookahead's."""

    def __init__(
        self,
        demand: Callable[[], StepDemand | None],
        layers: Callable[[], list[OffloadedLayer]],
        planner: PlecPlanner | None,
    ):
        self.demand = demand
        """The running step's demand."""
        self.layers = layers
        self.planner = planner
        self._scored: StepDemand | None = None
        """The demand of the running call, once scored."""

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        config = parts.config
        if config.path_predictor is None and config.lookahead is None:
            return None
        # A feature that knows the step's demand (the lookahead's draft) before the
        # scheduler's.
        sources = (f.step_demand() for f in built)
        demand = next((s for s in sources if s is not None), inputs.get("step_demand"))
        shared = config.cache_spec.shared_pool
        planner = PlecPlanner(config.plec_preload) if shared else None
        return cls(demand or (lambda: None), lambda: list(parts.layers.values()), planner)

    def equip(self, layer: OffloadedLayer) -> None:
        layer.add_counters(DemandCounters)

    def unequip(self, layer: OffloadedLayer) -> None:
        layer.remove_counters(DemandCounters)

    def stages(self, layer: OffloadedLayer) -> Sequence[Stage]:
        stages = [Stage("step_demand.score", "plan", self._score)]
        if self.planner is not None:
            stages.append(Stage("step_demand.plec_after", "finish", self._after))
        return stages

    def _score(self, call: DecodeCall) -> None:
        """Score the step's demand against the router; PLEC plans the shared pool by it."""
        demand = self.demand()
        if demand is None:
            return
        counters = call.stats.part(DemandCounters)
        self._scored = demand.scored(call.layer.index, call.router_host_ids, counters)
        if self._scored is not None and self.planner is not None:
            self.planner.before_layer(self._scored, call.layer, self.layers())

    def _after(self, call: DecodeCall) -> None:
        if self._scored is not None and self.planner is not None:
            self.planner.after_layer(self._scored, call.layer)
        self._scored = None


FEATURE = StepDemandFeature
