"""The routes of each decode call handed to a residency that predicts the next step from
them (``cache: markov``, :class:`~vllm_specexpert.tiers.eviction.MarkovPolicy`): a stage
of the ``plan`` step, after the host read and before the call loads what it misses, so
that this call's evictions keep what its sequences' next tokens are predicted to use.
Whether they do is judged by bytes, call by call: the prediction is on only while it
would load fewer experts than plain frequency
(:mod:`~vllm_specexpert.planner.residency_judge`; its counters are the layer's). A layer
whose every expert is resident evicts nothing and takes no stage."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm_specexpert.config.modes import CACHES
from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.pipeline import DecodeCall, Stage
from vllm_specexpert.planner.residency_judge import ResidencyJudge, ResidencyJudgeCounters
from vllm_specexpert.tiers.eviction import MarkovPolicy


class NextStepFeature(EngineFeature):
    name = "next_step"

    def __init__(self) -> None:
        self.judges: dict[str, ResidencyJudge] = {}
        """Layer name -> its judge, made when its stages are."""

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        return cls() if CACHES[parts.config.cache].learns_routes else None

    def equip(self, layer: OffloadedLayer) -> None:
        layer.add_counters(ResidencyJudgeCounters)

    def unequip(self, layer: OffloadedLayer) -> None:
        layer.remove_counters(ResidencyJudgeCounters)

    def stages(self, layer: OffloadedLayer) -> Sequence[Stage]:
        if layer.cache.identity:
            return ()
        cache = layer.cache
        self.judges[layer.name] = ResidencyJudge(cache.num_experts, cache.num_slots)
        return [Stage("next_step.routes", "plan", self._routes)]

    def _routes(self, call: DecodeCall) -> None:
        cache = call.layer.cache
        policy = cache.policy
        assert isinstance(policy, MarkovPolicy)  # (learns_routes)
        ids = call.router_host_ids
        policy.on_routes(ids)
        experts = np.arange(cache.num_experts)
        needed = np.zeros(cache.num_experts, dtype=bool)
        needed[ids.ravel()] = True
        policy.predicting = self.judges[call.layer.name].serve(
            needed,
            policy.predicted_keep(experts),
            policy.score(experts),
            len(ids),
            call.stats.part(ResidencyJudgeCounters),
        )


FEATURE = NextStepFeature
