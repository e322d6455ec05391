"""The engine's features (:mod:`.base`), in the order their hooks are called.

Adding a feature is a module here that ends with ``FEATURE = TheClass``, its line in
:data:`REGISTRY`, and its line in the package's map (``vllm_specexpert/__init__.py``).
A mode with a place of its own is such a module: its place, counters and feature, and
its miss policies in ``POLICIES`` (each built per layer with its place,
:meth:`~vllm_specexpert.policy.MissPolicy.for_layer`), with their traits in
:data:`~vllm_specexpert.config.modes.MISS_POLICIES` (read by config validation, before
any feature is built)."""

from __future__ import annotations

import importlib

from vllm_specexpert.config.modes import MISS_POLICIES
from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.pipeline import DecodeCall, Part, RunWrap, Stage
from vllm_specexpert.policy import SPINE_POLICIES, MissPolicy

__all__ = [
    "REGISTRY",
    "DecodeCall",
    "EngineFeature",
    "EngineParts",
    "Inputs",
    "Part",
    "RunWrap",
    "Stage",
    "build",
    "check",
    "check_inputs",
    "feature_classes",
    "miss_policy_classes",
]

REGISTRY = (
    "quality",
    "prediction",
    "low_bit",
    "mesh",
    "lookahead",
    "draft_routes",
    "step_demand",
    "next_step",
    "substitution",
    "host_compute",
    "scheduler_counters",
)
"""The features' modules. Their stages run in this order where no value of the call
orders them (:func:`vllm_specexpert.pipeline.ordered`); the first one's run wrap is
the outermost. Places are registered in this order too, the order their outputs are
added."""


def feature_classes() -> list[type[EngineFeature]]:
    """The registered features' classes, in order."""
    return [importlib.import_module(f"{__name__}.{name}").FEATURE for name in REGISTRY]


def miss_policy_classes() -> dict[str, type[MissPolicy]]:
    """Every miss policy by its config name (``miss_policy``): the spine's, and each
    feature module's ``POLICIES``."""
    modules = [importlib.import_module(f"{__name__}.{name}") for name in REGISTRY]
    found = [*SPINE_POLICIES, *(cls for m in modules for cls in getattr(m, "POLICIES", ()))]
    by_name = {cls.spec.name: cls for cls in found}
    return {name: by_name[name] for name in MISS_POLICIES if name in by_name}  # (its order)


def build(
    parts: EngineParts,
    inputs: Inputs,
    running: list[EngineFeature] | None = None,
    given: set[str] | None = None,
) -> list[EngineFeature]:
    """The features ``parts.config`` turns on, in registry order. With ``given`` input
    names, the ``running`` features that take none of them are kept as they are."""
    kept = {type(f): f for f in running or []} if given is not None else {}
    built: list[EngineFeature] = []
    for cls in feature_classes():
        old = kept.get(cls)
        if old is not None and given is not None and not given & set(cls.inputs):
            built.append(old)
            continue
        feature = cls.build(parts, inputs, built)
        if feature is not None:
            built.append(feature)
    return built


def check(parts: EngineParts, inputs: Inputs) -> None:
    """Raise a config error if a feature ``parts.config`` turns on lacks what it needs."""
    for cls in feature_classes():
        cls.check(parts, inputs)


def check_inputs(names: set[str]) -> None:
    """Refuse input names no feature declares (a typo would otherwise go unused)."""
    declared = {name for cls in feature_classes() for name in cls.inputs}
    unknown = sorted(names - declared)
    if unknown:
        raise TypeError(f"no feature takes the inputs {unknown} (declared: {sorted(declared)})")
