"""What a feature of the engine is: hooks that default to nothing, and what it is built
from.

The engine (:mod:`vllm_specexpert.engine`) is the exact spine; everything else is an
:class:`EngineFeature` in the ordered registry of :mod:`vllm_specexpert.features`. Like
vLLM's ``BaseOffloader``, a feature overrides only the hooks it needs: the base class is
its own null object. A feature keeps its own per-layer state, keyed by layer name, and
declares the inputs it is built from (:attr:`EngineFeature.inputs`).

A layer's call is a pipeline (:mod:`vllm_specexpert.pipeline`) composed once per layer
from what the features give it, through one hook, :meth:`~EngineFeature.stages`: stages
of its steps (each declaring the typed values of the call it makes and uses), a wrap of
the run step, a demand for exactness, a routing without the router. A call passes
through no feature that gave it nothing.

When the hooks are read: ``build`` and ``check`` at engine start, at a reconfigure and
when an input a feature declares is given; ``reserved_slots`` and ``equip`` when a layer
is equipped; ``stages`` and ``miss_policy`` when a layer's call is composed (when it is
equipped, whenever the features change, and when its cache stops holding every expert
in the slot of its id); ``step_demand`` when the features after it are built; the rest
when stats are read, on a reset, at the end of vLLM's warm-up, and at close. No hook is
read per call: a call runs only what ``stages`` gave.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.handoff import StepDemand
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.pipeline import Part
from vllm_specexpert.policy import MissPolicy
from vllm_specexpert.stats import Series
from vllm_specexpert.tiers.link import Link
from vllm_specexpert.tiers.store import ExpertStore

Inputs = Mapping[str, Any]
"""What the vLLM adapter handed the engine, by the names the features declare."""


@dataclass
class EngineParts:
    """What a feature is built with: the engine's parts under the config being run."""

    config: SpecExpertConfig
    layers: dict[str, OffloadedLayer]
    """Every offloaded MoE layer by name (a draft's target adds them after start)."""
    store: ExpertStore
    link: Link
    lock: threading.Lock
    """Held while layers change or another thread reads them."""
    output: str
    """What the running mode does to the model's output (``OffloadEngine.output``)."""


class EngineFeature:
    """One feature of the engine: every hook does nothing (module doc)."""

    name: ClassVar[str] = "feature"
    """The feature's name, and its section in the engine's stats."""
    inputs: ClassVar[tuple[str, ...]] = ()
    """The adapter's inputs it is built from: a feature is built again when one of them
    is given (``OffloadEngine.provide`` refuses a name no feature declares)."""

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        """The feature if ``parts.config`` turns it on and its inputs are there
        (``None``: off, or built again once they arrive); ``built``: the features
        before it in the registry."""
        return None

    @classmethod
    def check(cls, parts: EngineParts, inputs: Inputs) -> None:
        """Raise a config error if ``parts.config`` needs of this feature what the loaded
        layers or ``inputs`` lack (at engine start and before a reconfigure)."""

    def reserved_slots(self, layer: OffloadedLayer, slots: int) -> int:
        """How many of the layer's ``slots`` the feature takes for itself (before its
        cache is made)."""
        return 0

    def equip(self, layer: OffloadedLayer) -> None:
        """Give a layer what the feature needs of it (after its cache is made: when the
        feature is built, and for a layer added later)."""

    def unequip(self, layer: OffloadedLayer) -> None:
        """Release what :meth:`equip` made for the layer (before it is equipped again)."""

    def miss_policy(self, policy: MissPolicy, layer: OffloadedLayer) -> MissPolicy:
        """The layer's miss policy, given the one before (a feature may wrap it: the mesh
        sends its peers' experts to them first)."""
        return policy

    def stages(self, layer: OffloadedLayer) -> Sequence[Part]:
        """What it adds to the layer's call (:data:`~vllm_specexpert.pipeline.Part`):
        stages of its steps, a wrap of the run step, a demand for exactness, a routing
        without the router."""
        return ()

    def step_demand(self) -> Callable[[], StepDemand | None] | None:
        """The running step's predicted demand, if this feature knows it (the lookahead's
        draft): preferred to the scheduler's (``step_demand``)."""
        return None

    def stats(self) -> dict | None:
        """The feature's section of the engine's stats (``None``: none)."""
        return None

    def series(self) -> list[Series]:
        """Its series on ``/metrics``, as data (the collector there sees no feature)."""
        return []

    def summary(self) -> str:
        """Its part of the engine's one-line summary (``""``: none)."""
        return ""

    def reset_stats(self) -> None:
        """Its counters at zero."""

    def restart(self) -> None:
        """The engine went back to its start state (after vLLM's warm-up passes)."""

    def close(self) -> None:
        """Release what it holds (peers, threads)."""
