"""The token scheduler's counters as an engine feature. The scheduler runs in vLLM's
engine-core process (with a ``path_predictor``:
:mod:`vllm_specexpert.schedule.token_scheduler`) and hands its counters to the workers
with every step (:mod:`vllm_specexpert.handoff`); this feature serves them as its stats
section and its ``/metrics`` series (``specexpert_scheduler_*``). It has no hook in the
layer call."""

from __future__ import annotations

from vllm_specexpert import handoff
from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.handoff import SchedulerStats
from vllm_specexpert.stats import Series, metric_name


class SchedulerCountersFeature(EngineFeature):
    name = "scheduler"

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        return cls() if parts.config.path_predictor is not None else None

    def stats(self) -> dict | None:
        """The scheduler's counters as of its latest step (``None`` before one)."""
        return handoff.scheduler_stats()

    def series(self) -> list[Series]:
        counted = handoff.scheduler_stats()
        if counted is None:
            return []
        gauges = SchedulerStats.gauges()
        return [
            Series(
                metric_name(f"scheduler_{name}"), "gauge" if name in gauges else "counter", doc
            ).add(counted[name])
            for name, doc in SchedulerStats.docs().items()
        ]


FEATURE = SchedulerCountersFeature
