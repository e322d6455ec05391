"""The routes of each decode call handed to a residency that predicts the next step from
them (``cache: markov``, :class:`~vllm_specexpert.tiers.eviction.MarkovPolicy`): a stage
of the ``plan`` step, after the host read and before the call loads what it misses, so
that this call's evictions keep what its sequences' next tokens are predicted to use.
Whether they do is judged by bytes, call by call: the prediction is on only while it
would load no more experts than plain frequency
(:mod:`~vllm_specexpert.planner.bytes_judge`; its counters are the layer's). A layer
whose every expert is resident evicts nothing and takes no stage."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_specexpert.config.modes import CACHES
from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.pipeline import DecodeCall, Stage
from vllm_specexpert.planner.bytes_judge import BytesJudge, needed_of
from vllm_specexpert.stats import Counters, counter
from vllm_specexpert.tiers.eviction import MarkovPolicy


@dataclass
class NextStepCounters(Counters):
    """The judge of one layer's prediction (beside the engine's counters while ``cache:
    markov`` runs)."""

    calls_predicted: int = counter(
        "Decode calls whose evictions kept by the residency's prediction (its ghost had "
        "loaded no more experts than plain frequency's over the bucket's last 64 calls)."
    )
    calls_plain: int = counter(
        "Decode calls whose evictions kept by plain frequency (lrfu's decayed uses): "
        "the prediction's ghost had loaded more, so it was off."
    )
    ghost_loads_predicted: int = counter(
        "Experts the ghost residency kept by the prediction would have loaded."
    )
    ghost_loads_plain: int = counter(
        "Experts the ghost residency kept by plain frequency would have loaded."
    )


class NextStepFeature(EngineFeature):
    name = "next_step"

    def __init__(self) -> None:
        self.judges: dict[str, BytesJudge] = {}
        """Layer name -> its judge, made when its stages are."""
        self.verdicts: dict[str, bool] = {}
        """Layer name -> whether its prediction was on at its last decode call."""

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        return cls() if CACHES[parts.config.cache].learns_routes else None

    def stats(self) -> dict | None:
        """How many layers keep by the prediction now, and how many by plain frequency."""
        on = sum(self.verdicts.values())
        return {"layers_predicting": on, "layers_plain": len(self.verdicts) - on}

    def equip(self, layer: OffloadedLayer) -> None:
        layer.add_counters(NextStepCounters)

    def unequip(self, layer: OffloadedLayer) -> None:
        layer.remove_counters(NextStepCounters)

    def stages(self, layer: OffloadedLayer) -> Sequence[Stage]:
        if layer.cache.identity:
            return ()
        cache = layer.cache
        self.judges[layer.name] = BytesJudge(cache.num_experts, cache.num_slots)
        return [Stage("next_step.routes", "plan", self._routes)]

    def _routes(self, call: DecodeCall) -> None:
        cache = call.layer.cache
        policy = cache.policy
        assert isinstance(policy, MarkovPolicy)  # (learns_routes)
        ids = call.router_host_ids
        policy.on_routes(ids)
        experts = np.arange(cache.num_experts)
        judged = self.judges[call.layer.name].serve(
            needed_of(ids, cache.num_experts),
            policy.predicted_keep(experts),
            policy.score(experts),
            len(ids),
        )
        policy.predicting = self.verdicts[call.layer.name] = judged.on
        counters = call.stats.part(NextStepCounters)
        counters.calls_predicted += judged.on
        counters.calls_plain += not judged.on
        counters.ghost_loads_predicted += judged.technique_loads
        counters.ghost_loads_plain += judged.plain_loads


FEATURE = NextStepFeature
