"""Costs measured online, per choice: the recent samples of each key (a batch-size bucket
and what was chosen), the first of each key dropped (taken on a cache that the choice
before it left: a start, a ``reconfigure``, a switch). The governors that choose by
measured time keep their samples here: the draft length's (:mod:`.governor`) and the
measured switches (:mod:`.switch`: the token scheduler's grouping, a prefetch)."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

import numpy as np

Key = TypeVar("Key", bound=Hashable)

WINDOW = 8
"""Recent samples kept per key."""


def bucket(batch: int) -> int:
    """The batch-size bucket of ``batch`` sequences: the next power of two."""
    return 1 << max(batch - 1, 0).bit_length()


class MeasuredCosts(Generic[Key]):
    """Recent samples per key (module doc)."""

    def __init__(self, window: int = WINDOW) -> None:
        self.samples: dict[Key, deque[float]] = {}
        self.taken: dict[Key, int] = {}
        """Key -> samples offered, the dropped first one included."""
        self.window = window

    def add(self, key: Key, value: float) -> bool:
        """Offers a sample of ``key``; whether it was kept (the first is not)."""
        self.taken[key] = self.taken.get(key, 0) + 1
        if self.taken[key] == 1:
            return False
        self.samples.setdefault(key, deque(maxlen=self.window)).append(value)
        return True

    def restart(self, key: Key) -> None:
        """The next sample of ``key`` is a first one again (dropped): what was measured
        before stays, and is still the estimate until newer samples push it out."""
        if self.taken.get(key):
            self.taken[key] = 0

    def kept(self, key: Key) -> int:
        return len(self.samples.get(key, ()))

    def median(self, key: Key) -> float | None:
        """The median of ``key``'s recent samples (robust to one slow step); ``None``:
        none kept yet."""
        mine = self.samples.get(key)
        return float(np.median(mine)) if mine else None

    def medians(self) -> dict[Key, float]:
        return {key: float(np.median(values)) for key, values in self.samples.items() if values}
