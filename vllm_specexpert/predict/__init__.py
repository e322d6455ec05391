"""Predictors of the next MoE layer's experts (see :mod:`.base` for the interface), and
the routing-path predictor of a step's experts (:mod:`.path`)."""

from vllm_specexpert.predict.base import (
    FusedRouting,
    LayerState,
    NextLayerRouting,
    Prediction,
    Predictor,
)
from vllm_specexpert.predict.quasi_hidden import QuasiHiddenPredictor, residual_scale
from vllm_specexpert.predict.router import RouterPredictor

PREDICTOR_CLASSES: dict[str, type[Predictor] | None] = {
    "none": None, "router": RouterPredictor, "quasi_hidden": QuasiHiddenPredictor,
}
"""Every next-layer predictor by its config name (``predictor``; ``none``: no class),
the keys of :data:`~vllm_specexpert.config.modes.PREDICTORS`."""

__all__ = [
    "PREDICTOR_CLASSES",
    "FusedRouting",
    "LayerState",
    "NextLayerRouting",
    "Prediction",
    "Predictor",
    "QuasiHiddenPredictor",
    "RouterPredictor",
    "residual_scale",
]
