"""Reads ahead through the shared region: the following layer's reads start while this
layer computes (issue 74: the disk never idles while a read is owed).

Where a batch needs more experts than a layer's own slots hold, its call reads the
missing ones into the shared region (:mod:`~vllm_specexpert.tiers.shared_region`), and
its next call, one step later, needs nearly the same ones (at a batch of 32 or more
nearly every expert). So before a layer's launch the following layer's last demand is
read ahead, in file order, up to :data:`READ_AHEAD_WINDOWS` windows of ``top_k``
experts, into rows the launch does not use: the disk reads while the kernel runs, and
what the following call then reads on demand is that much less. Exactness is untouched:
the following call still runs once every expert it needs has landed, in one launch.
At a batch of one the following layer's last call fitted its own slots, and nothing is
read ahead (a guess would cost a read the cache may not need).
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.pipeline import DecodeCall, Stage

READ_AHEAD_WINDOWS = 1
"""Windows of ``top_k`` experts read ahead per layer call: one token's experts, as
``stream``'s window (what its reads overlap)."""


class RegionReadAhead:
    """One layer's read ahead of the layer after it in the pass (its ``following``, found
    per call: the layers are linked once they are all loaded)."""

    def __init__(self, following: Callable[[], OffloadedLayer | None]) -> None:
        self.following = following

    def stage(self) -> Stage:
        return Stage("region.read_ahead", "plan", self._plan)

    def _plan(self, call: DecodeCall) -> None:
        call.before_kernel.append(self._read)

    def _read(self) -> None:
        nxt = self.following()
        if nxt is None:
            return
        loader = nxt.loader
        expected = loader.last_needed
        if expected is None or len(expected) <= nxt.cache.num_slots:
            return  # (its own slots held its last call: no read is owed)
        count = READ_AHEAD_WINDOWS * nxt.top_k
        loader.read_ahead(expected, nxt.stats.decode, count)
