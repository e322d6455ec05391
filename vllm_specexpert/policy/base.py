"""The miss-policy interface: what a layer does with routed experts that are not resident.

Per decode call a policy returns a :class:`MissPlan` (per (token, k) entry: the device
or a place of the layer's, :mod:`vllm_specexpert.places`), which
:mod:`vllm_specexpert.execute` carries out.
No plan means load what is missing (``fetch``, bit-exact). Prefill never reaches a
policy. Traits (``spec``) come from :data:`~vllm_specexpert.config.modes.MISS_POLICIES`.
A layer's policy is built when its call is composed (:meth:`MissPolicy.for_layer`), with
the places it gives entries to: a mode that has a place is one module under
:mod:`vllm_specexpert.features` (its place, counters, policies and feature).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from vllm_specexpert.config.modes import MISS_POLICIES, MissPolicySpec
from vllm_specexpert.places import Place, PlaceMissing, Places
from vllm_specexpert.policy.context import MissContext


@dataclass
class MissPlan:
    """How one layer call resolves its routing: ``[T, K]`` masks over its entries by the
    name of the place that takes them; an entry in none runs on the device (loaded if
    missing)."""

    topk_ids: np.ndarray
    """Expert ids to run: the router's, or a place's in their stead (a substitute)."""
    places: dict[str, np.ndarray] = field(default_factory=dict)
    renormalize: bool = False
    """Scale each token's computed weights so they sum to what all its weights did."""


class MissPolicy:
    """Decides, per decode call of one MoE layer, what happens to missing experts."""

    spec: ClassVar[MissPolicySpec] = MISS_POLICIES["fetch"]
    """The policy's traits (:mod:`vllm_specexpert.config.modes`), by its config name."""

    @classmethod
    def for_layer(cls, places: Places) -> MissPolicy:
        """The policy of one layer, built with the places it gives entries to (its
        mode's module registered them on the layer: :meth:`Places.of`); a policy that
        uses none needs none."""
        return cls()

    @classmethod
    def of_layer(cls, places: Places) -> MissPolicy:
        """:meth:`for_layer`, or, while a place it needs is not registered yet,
        :class:`WithoutPlace`."""
        try:
            return cls.for_layer(places)
        except PlaceMissing as missing:
            return WithoutPlace(cls, missing)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def plans(self) -> bool:
        """Whether it ever makes a plan (one that does not runs every call as the exact
        runner does: composed so, it is never asked)."""
        return type(self).plan is not MissPolicy.plan

    def plan(
        self,
        ids: np.ndarray,
        resident: np.ndarray,
        topk_weights: torch.Tensor,
        context: MissContext,
    ) -> MissPlan | None:
        """Decide about the entries of ``ids`` ([T, K]) not ``resident`` ([E]; at least
        one). ``None``: load them (``fetch``)."""
        return None


class PlacedPolicy(MissPolicy):
    """A policy that gives entries to one place of its mode's (:attr:`place_kind`), built
    with the layer's (a subclass annotates :attr:`place` with its class)."""

    place_kind: ClassVar[type[Place]]

    def __init__(self, place: Place) -> None:
        self.place = place

    @classmethod
    def for_layer(cls, places: Places) -> MissPolicy:
        return cls(places.of(cls.place_kind))


class WithoutPlace(MissPolicy):
    """A layer's policy while a place it gives entries to is not registered (its feature
    is built once an input arrives, and the layer's call is then composed again): a
    call that has to plan fails, naming the place."""

    def __init__(self, policy: type[MissPolicy], missing: Exception) -> None:
        self.policy = policy
        self.missing = missing

    @property
    def spec(self) -> MissPolicySpec:  # type: ignore[override]  # (the policy's traits)
        return self.policy.spec

    def plan(
        self,
        ids: np.ndarray,
        resident: np.ndarray,
        topk_weights: torch.Tensor,
        context: MissContext,
    ) -> MissPlan | None:
        raise RuntimeError(f"miss_policy {self.policy.spec.name!r}: {self.missing}")
