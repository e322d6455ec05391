"""The engine's features (:mod:`.base`), in the order their hooks are called.

Adding a feature is a module here that ends with ``FEATURE = TheClass``, its line in
:data:`REGISTRY`, and its line in the package's map (``vllm_specexpert/__init__.py``)."""

from __future__ import annotations

import importlib

from vllm_specexpert.features.base import (
    DecodeCall,
    EngineFeature,
    EngineParts,
    Inputs,
    Resolve,
)

__all__ = [
    "REGISTRY",
    "DecodeCall",
    "EngineFeature",
    "EngineParts",
    "Inputs",
    "Resolve",
    "feature_classes",
]

REGISTRY = (
    "quality",
    "prediction",
    "mesh",
    "lookahead",
    "step_demand",
    "routing_statistics",
    "low_bit",
)
"""The features' modules, in hook order: the first one's ``resolve`` is the outermost."""


def feature_classes() -> list[type[EngineFeature]]:
    """The registered features' classes, in order."""
    return [importlib.import_module(f"{__name__}.{name}").FEATURE for name in REGISTRY]
