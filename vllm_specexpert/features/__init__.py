"""The engine's features (:mod:`.base`), built in order by one factory from the config.

Adding a feature is a file here and a line in :func:`build`."""

from __future__ import annotations

from typing import Any

from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.features.base import DecodeCall, EngineFeature, Resolve
from vllm_specexpert.features.inputs import FeatureInputs, check_reconfigure, check_start
from vllm_specexpert.features.lookahead import LookaheadFeature
from vllm_specexpert.features.mesh import MeshFeature
from vllm_specexpert.features.prediction import PredictionFeature
from vllm_specexpert.features.quality import QualityFeature
from vllm_specexpert.features.step_demand import StepDemandFeature
from vllm_specexpert.planner.plec import PlecPlanner
from vllm_specexpert.predict import PREDICTOR_CLASSES
from vllm_specexpert.quality import QualityMonitor

__all__ = [
    "DecodeCall",
    "EngineFeature",
    "FeatureInputs",
    "Resolve",
    "build",
    "check_reconfigure",
    "check_start",
]


def build(config: SpecExpertConfig, engine: Any) -> list[EngineFeature]:
    """The features ``config`` turns on, in order, wired to ``engine``'s layers, link,
    miss policy, shared pool and the inputs handed to it (:class:`FeatureInputs`). A
    feature whose inputs are not there yet is left out (the engine builds again when
    they arrive)."""
    features: list[EngineFeature] = []
    inputs: FeatureInputs = engine.inputs
    monitor = QualityMonitor.of(config.quality, inputs.logit_head, engine.layers)
    if monitor is not None:
        features.append(QualityFeature(monitor))
    predictor = PREDICTOR_CLASSES[config.predictor]
    if predictor is not None:
        features.append(
            PredictionFeature(
                predictor.build(inputs.predictor_inputs),
                config,
                engine.miss_policy,
                engine.layers.__getitem__,
                lambda: engine.link,
            )
        )
    if inputs.peer_tier is not None and config.mesh is not None:
        features.append(
            MeshFeature(
                inputs.peer_tier,
                inputs.hot_experts,
                config.mesh,
                engine.output,
                engine.layers.__getitem__,
            )
        )
    demand = lambda: engine.step_demand  # the scheduler's, set per layer call
    if config.lookahead is not None:
        lookahead = LookaheadFeature(
            config.lookahead, list(engine.layers.values()), inputs.draft, engine.lock
        )
        features.append(lookahead)
        demand = lookahead.demand
    if config.path_predictor is not None or config.lookahead is not None:
        planner = PlecPlanner(engine.pool, config.plec_preload) if engine.pool is not None else None
        features.append(StepDemandFeature(demand, lambda: list(engine.layers.values()), planner))
    return features
