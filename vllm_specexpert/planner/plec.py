"""PLEC's planner (ExpertFlow §3.4): a slot pool shared by every layer, planned by the
predicted demand of each step (:class:`~vllm_specexpert.handoff.StepDemand`).

* At a step's first decode call every layer's predicted demand becomes the pool's
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


class PlecPlanner:
    """Keeps a :class:`SharedSlotPool`'s predicted uses and preloads by them (module doc)."""

    def __init__(self, pool: SharedSlotPool, preload: str) -> None:
        self.pool = pool
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
            self.pool.predicted_uses[each.cache.index] = 0 if row is None else row
        if self.preload != "none":
            self._preload(layers[list(layers).index(layer) + 1 :])

    def after_layer(self, demand: StepDemand, layer: PlannedLayer) -> None:
        """``layer`` ran its step: plan for the group expected next step."""
        if demand.next_layers is None:
            return
        row = demand.next_layers.get(layer.index)
        self.pool.predicted_uses[layer.cache.index] = 0 if row is None else row
        if self.preload == "next":
            self._preload([layer])

    def _preload(self, layers: Sequence[PlannedLayer]) -> None:
        """Load ``layers``' predicted, non-resident experts into the pool's spare slots."""
        room = self.pool.spare()
        for layer in layers:
            if room <= 0:
                return
            row = self.pool.predicted_uses[layer.cache.index]
            wanted = np.flatnonzero((row > 0) & (layer.cache.expert_slot < 0))
            wanted = wanted[np.argsort(-row[wanted], kind="stable")][:room]
            layer.loader.preload(wanted, layer.stats.decode)  # predictions are for decode
            room -= len(wanted)
