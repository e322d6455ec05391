"""The routes of each decode call handed to a residency that predicts the next step from
them (``cache: markov``, :class:`~vllm_specexpert.tiers.eviction.MarkovPolicy`): a stage
of the ``plan`` step, after the host read and before the call loads what it misses, so
that this call's evictions keep what its sequences' next tokens are predicted to use.
A layer whose every expert is resident evicts nothing and takes no stage."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_specexpert.config.modes import CACHES
from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.pipeline import DecodeCall, Stage


class NextStepFeature(EngineFeature):
    name = "next_step"

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        return cls() if CACHES[parts.config.cache].learns_routes else None

    def stages(self, layer: OffloadedLayer) -> Sequence[Stage]:
        if layer.cache.identity:
            return ()
        return [Stage("next_step.routes", "plan", self._routes)]

    @staticmethod
    def _routes(call: DecodeCall) -> None:
        call.layer.cache.policy.on_routes(call.router_host_ids)


FEATURE = NextStepFeature
