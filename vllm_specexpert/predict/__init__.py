"""Predictors of the next MoE layer's experts (see :mod:`.base` for the interface)."""

from vllm_specexpert.predict.base import LayerState, NextLayerRouting, Prediction, Predictor
from vllm_specexpert.predict.quasi_hidden import QuasiHiddenPredictor
from vllm_specexpert.predict.router import RouterPredictor

PREDICTORS = ("none", "router", "quasi_hidden")

__all__ = [
    "PREDICTORS",
    "LayerState",
    "NextLayerRouting",
    "Prediction",
    "Predictor",
    "QuasiHiddenPredictor",
    "RouterPredictor",
]
