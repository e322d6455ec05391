"""Places: where an entry of a layer call runs besides the device's slots, behind one
registry per layer.

A miss plan (:class:`~vllm_specexpert.policy.MissPlan`) maps place names to ``[T, K]``
masks. A feature that runs experts somewhere registers a :class:`Place` on each layer it
equips (:meth:`Places.register`); the place owns its state and declares its counters
(:class:`PlaceCounters`), which the call's phase keeps beside the engine's. The executor,
the counting, the stats and ``/metrics`` loop over the registry, so they name no place.
The one place every layer has is :class:`Dropped` (entries not run at all).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.stats import Counters, PhaseStats, counter


@dataclass
class PlaceCounters(Counters):
    """A place's counters; a subclass names its fields after its place (they sit beside
    the engine's in a phase's stats), one of them its entries (:attr:`entries_field`)."""

    entries_field: ClassVar[str] = ""

    def add_entries(self, count: int) -> None:
        setattr(self, self.entries_field, getattr(self, self.entries_field) + count)


class Place:
    """Where entries of a layer call run (the base: nowhere, computing nothing)."""

    name: ClassVar[str] = "place"
    """Its key in a miss plan's ``places``."""
    counters: ClassVar[type[PlaceCounters]]
    """Its counters, kept per phase (:meth:`PhaseStats.part`)."""
    computes: ClassVar[bool] = True
    """Whether its entries are computed (``False``: dropped, their weight renormalised
    over the others under a plan that says so)."""
    on_device: ClassVar[bool] = False
    """Whether its entries run in the device's launch (their ids already replaced in the
    plan): then nothing is staged, and they are not counted as fetched."""
    admits: ClassVar[bool] = False
    """Whether its experts may then be loaded into the cache on an idle link
    (``admit_host_experts``): it computes them from a copy the cache could hold."""

    def stage(self, call: LayerCall, entries: np.ndarray) -> Any:
        """Start the ``[T, K]`` ``entries`` of ``call`` before the device's kernel; what
        :meth:`finish` needs."""
        return None

    def finish(self, job: Any, out: torch.Tensor) -> np.ndarray | None:
        """Add the weighted outputs to ``out``; the entries not computed, if any (they
        run on the device)."""
        return None


@dataclass
class DroppedCounters(PlaceCounters):
    entries_field = "dropped_entries"
    dropped_entries: int = counter("Missed entries not run at all (``drop``; output not exact).")


class Dropped(Place):
    """Entries not run (``drop``, and an expert the slow tier could not supply)."""

    name = "dropped"
    counters = DroppedCounters
    computes = False


P = TypeVar("P", bound=Place)


class PlaceMissing(RuntimeError):
    """A layer lacks the place a policy gives entries to."""


class Places:
    """One layer's places by name, in the order they were registered (the order their
    outputs are added)."""

    def __init__(self) -> None:
        self._places: dict[str, Place] = {}
        self.register(Dropped())

    def register(self, place: Place) -> None:
        if place.name in self._places:
            raise RuntimeError(f"place {place.name!r} is registered twice on one layer")
        self._places[place.name] = place

    def unregister(self, name: str) -> None:
        self._places.pop(name, None)

    def get(self, name: str) -> Place | None:
        return self._places.get(name)

    def of(self, kind: type[P]) -> P:
        """The layer's place of class ``kind`` (what a miss policy gives entries to, found
        when the layer's policy is built, typed)."""
        place = self._places.get(kind.name)
        if not isinstance(place, kind):  # (its feature is off, or waits for an input)
            raise PlaceMissing(f"the layer has no place {kind.name!r} ({kind.__name__})")
        return place

    def __getitem__(self, name: str) -> Place:
        place = self._places.get(name)
        if place is None:  # a policy gives entries only to places its features registered
            raise RuntimeError(f"a miss plan gave entries to {name!r}, which the layer lacks")
        return place

    def __iter__(self) -> Iterator[Place]:
        return iter(self._places.values())

    def count(self, plan: dict[str, np.ndarray], stats: PhaseStats) -> None:
        """Each place's entries in ``plan`` added to its counters in ``stats``."""
        for name, mask in plan.items():
            stats.part(self[name].counters).add_entries(int(np.count_nonzero(mask)))
