"""Predictors of the next MoE layer's experts (see :mod:`.base` for the interface)."""

from vllm_specexpert.predict.base import (
    FusedRouting,
    LayerState,
    NextLayerRouting,
    Prediction,
    Predictor,
)
from vllm_specexpert.predict.planner import PrefetchPlanner, worth_threshold
from vllm_specexpert.predict.quasi_hidden import QuasiHiddenPredictor, residual_scale
from vllm_specexpert.predict.router import RouterPredictor

__all__ = [
    "FusedRouting",
    "LayerState",
    "NextLayerRouting",
    "Prediction",
    "Predictor",
    "PrefetchPlanner",
    "QuasiHiddenPredictor",
    "RouterPredictor",
    "residual_scale",
    "worth_threshold",
]
