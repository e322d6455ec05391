"""Whether a technique that chooses what a layer's slots hold keeps running, judged by
bytes: each of the layer's decode calls replayed, as they come, through two ghost
residencies of its slots, one with the technique (a prediction's eviction order, a
prefetch's reads) and one by plain frequency alone; the technique runs only while its
ghost loaded no more experts over the batch-size bucket's last :data:`JUDGE_WINDOW`
calls (issue 76).

A counterfactual replay, not an alternation: nothing is paid to find out and no clock is
read, so the judgment holds from the first call. A tie keeps the technique: a
prediction's order is plain frequency's until it has counted a route, and a prefetch
whose every read is used reads the same bytes, earlier (an equal count is no evidence
against it; keeping ``markov``'s prediction off until it had loaded fewer lost most of
its gain at one sequence in the embedded model's 16-token replay, 1.00x ``lrfu``
against 0.98x). Ghosts hold ids only, no bytes. They model one launch over the call's
distinct experts, each missing one loaded once, the lowest kept first to go; where the
real call runs token groups or shares a region's rows, both ghosts leave that out
alike, so the comparison is like for like. Every expert of a layer is one size, so
loads compare as bytes.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np

from vllm_specexpert.planner.measured import bucket

JUDGE_WINDOW = 64
"""Decode calls of a bucket the judgment counts: a window, not a decay, so that a
technique which at best ties (a prefetch) comes back on once its excess has left it
(under a decay an old excess would shrink but never end)."""


def needed_of(router_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """``bool [E]``: the experts a call's routes (``[T, K]``) use."""
    needed = np.zeros(num_experts, dtype=bool)
    needed[router_ids.ravel()] = True
    return needed


class GhostResidency:
    """Which experts a layer's ``num_slots`` slots would hold under one order, starting
    from the engine's warm start (the first ``num_slots`` experts)."""

    def __init__(self, num_experts: int, num_slots: int) -> None:
        self.num_slots = num_slots
        self.resident = np.zeros(num_experts, dtype=bool)
        self.resident[:num_slots] = True

    def serve(self, needed: np.ndarray, keep: np.ndarray) -> int:
        """``needed`` (``bool [E]``) made resident, the lowest ``keep`` going first
        (``needed`` last); returns how many were loaded."""
        loads = int(np.count_nonzero(needed & ~self.resident))
        held = np.flatnonzero(self.resident | needed)
        over = len(held) - self.num_slots
        if over > 0:
            # lexsort: last key is primary -> not needed first, then the lowest keep.
            going = held[np.lexsort((keep[held], needed[held]))[:over]]
            self.resident[held] = True
            self.resident[going] = False
        else:
            self.resident[held] = True
        return loads


class Judgment(NamedTuple):
    """One call's judgment."""

    on: bool
    """Whether the technique runs (for this call's evictions, or the next prefetch)."""
    technique_loads: int
    """Experts the technique's ghost loaded for the call (its reads ahead included)."""
    plain_loads: int
    """Experts plain frequency's ghost loaded for it."""


class BytesJudge:
    """The judgment of one layer (module doc)."""

    def __init__(self, num_experts: int, num_slots: int) -> None:
        self.technique = GhostResidency(num_experts, num_slots)
        self.plain = GhostResidency(num_experts, num_slots)
        self.recent: dict[int, deque[tuple[int, int]]] = {}
        """Batch bucket -> its last calls' ghost loads, ``(technique, plain)``."""
        self.totals: dict[int, np.ndarray] = {}
        """Batch bucket -> the sums of :attr:`recent`."""
        self._ahead = 0
        """Loads of the technique's reads ahead of the coming call."""

    def ahead(self, experts: np.ndarray, keep: np.ndarray) -> None:
        """The technique reads ``experts`` (``bool [E]``) before the coming call (a
        prefetch: counted whether or not it is submitted, what it would have read)."""
        self._ahead += self.technique.serve(experts, keep)

    def serve(
        self, needed: np.ndarray, technique_keep: np.ndarray, plain_keep: np.ndarray, batch: int
    ) -> Judgment:
        """A decode call of ``batch`` sequences needs ``needed`` (``bool [E]``): both
        ghosts serve it by their orders (``[E]``, the higher the later to go)."""
        technique = self._ahead + self.technique.serve(needed, technique_keep)
        plain = self.plain.serve(needed, plain_keep)
        self._ahead = 0
        key = bucket(batch)
        recent = self.recent.setdefault(key, deque())
        totals = self.totals.setdefault(key, np.zeros(2, dtype=np.int64))
        recent.append((technique, plain))
        totals += (technique, plain)
        if len(recent) > JUDGE_WINDOW:
            totals -= recent.popleft()
        return Judgment(bool(totals[0] <= totals[1]), technique, plain)
