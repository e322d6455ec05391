"""PLEC's planner (ExpertFlow §3.4): slot pools shared by layers (one for all, or one per
run of consecutive layers where the kernel's reach splits it), planned by the predicted
demand of each step (:class:`~vllm_specexpert.handoff.StepDemand`).

* At a step's first decode call every layer's predicted demand becomes its pool's
  predicted uses (the victim order's first key); with ``plec_preload`` ``step`` or
  ``next`` the later layers' predicted experts are loaded, nearest layer first, into
  slots holding nothing predicted.
* After a layer ran, the next group's (token scheduler) predicted experts become its
  predicted uses and, with ``plec_preload: next``, are loaded now, overlapping this
  group's compute.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm_specexpert.handoff import StepDemand
from vllm_specexpert.planner import PlannedLayer
from vllm_specexpert.tiers.slots import SharedSlotPool


def shared_pool(layer: PlannedLayer) -> SharedSlotPool:
    """The shared pool ``layer``'s cache is in (``plec``)."""
    pool = layer.cache.pool
    assert isinstance(pool, SharedSlotPool), "plec plans shared pools only"
    return pool


class PlecPlanner:
    """Keeps the :class:`SharedSlotPool` s' predicted uses and preloads by them (module doc)."""

    def __init__(self, preload: str) -> None:
        self.preload = preload
        """``plec_preload``: ``none``, ``step`` or ``next``."""
        self._planned: StepDemand | None = None
        """The step demand the pool was last planned for."""

    def before_layer(
        self, demand: StepDemand, layer: PlannedLayer, layers: Sequence[PlannedLayer]
    ) -> None:
        """A decode call of ``layer`` (of ``layers``, in order) starts in the step of
        ``demand``: plan the step if it is the step's first call."""
        if demand is self._planned:
            return
        self._planned = demand
        for each in layers:
            row = demand.layers.get(each.index)
            shared_pool(each).predicted_uses[each.cache.index] = 0 if row is None else row
        if self.preload != "none":
            self._preload(layers[list(layers).index(layer) + 1 :])

    def after_layer(self, demand: StepDemand, layer: PlannedLayer) -> None:
        """``layer`` ran its step: plan for the group expected next step."""
        if demand.next_layers is None:
            return
        row = demand.next_layers.get(layer.index)
        shared_pool(layer).predicted_uses[layer.cache.index] = 0 if row is None else row
        if self.preload == "next":
            self._preload([layer])

    def _preload(self, layers: Sequence[PlannedLayer]) -> None:
        """Load ``layers``' predicted, non-resident experts into their pools' spare slots."""
        rooms: dict[int, int] = {}
        for layer in layers:
            pool = shared_pool(layer)
            room = rooms.setdefault(id(pool), pool.spare())
            if room <= 0:
                continue
            row = pool.predicted_uses[layer.cache.index]
            wanted = np.flatnonzero((row > 0) & (layer.cache.expert_slot < 0))
            wanted = wanted[np.argsort(-row[wanted], kind="stable")][:room]
            layer.loader.preload(wanted, layer.stats.decode)  # predictions are for decode
            rooms[id(pool)] = room - len(wanted)
