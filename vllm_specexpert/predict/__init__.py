"""Predictors of the next MoE layer's experts (see :mod:`.base` for the interface), and
the routing-path predictor of a step's experts (:mod:`.path`)."""

from vllm_specexpert.predict.base import (
    FusedRouting,
    LayerState,
    NextLayerRouting,
    Prediction,
    Predictor,
    PredictorInputs,
)
from vllm_specexpert.predict.estimator import EstimatorPredictor, HybridPredictor
from vllm_specexpert.predict.quasi_hidden import QuasiHiddenPredictor, residual_scale
from vllm_specexpert.predict.router import RouterPredictor

PREDICTOR_CLASSES: dict[str, type[Predictor] | None] = {
    "none": None,
    "router": RouterPredictor,
    "quasi_hidden": QuasiHiddenPredictor,
    "estimator": EstimatorPredictor,
    "hybrid": HybridPredictor,
}
"""Every next-layer predictor by its config name (``predictor``; ``none``: no class),
the keys of :data:`~vllm_specexpert.config.modes.PREDICTORS`."""

__all__ = [
    "PREDICTOR_CLASSES",
    "EstimatorPredictor",
    "FusedRouting",
    "HybridPredictor",
    "LayerState",
    "NextLayerRouting",
    "Prediction",
    "Predictor",
    "PredictorInputs",
    "QuasiHiddenPredictor",
    "RouterPredictor",
    "residual_scale",
]
