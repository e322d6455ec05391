"""Reads ahead through the shared region: the following layer's reads start while this
layer computes (issue 74: the disk never idles while a read is owed).

Where a batch needs more experts than a layer's own slots hold, its call reads the
missing ones into the shared region (:mod:`~vllm_specexpert.tiers.shared_region`).
Where a call needs nearly every expert (at least :data:`SWEEP_SHARE` of them: top-4 of
64 at 32 sequences or more), the next call of each layer needs nearly the same ones. So
before such a layer's launch the following layer's last demand, if it was such a call
too, is read ahead, in file order, up to :data:`READ_AHEAD_WINDOWS` windows of ``top_k``
experts, into rows the launch does not use: the disk reads while the kernel runs, and
what the following call then reads on demand is that much less. Exactness is untouched:
the following call still runs once every expert it needs has landed, in one launch.
Below that share a guess costs a read the call may not need, so nothing is read ahead
(docs/design.md: read ahead after every call that passed its own slots, the miniature
read 1.2x the bytes at one sequence, the first decode step reading the prompt's experts).
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.pipeline import DecodeCall, Stage

READ_AHEAD_WINDOWS = 1
"""Windows of ``top_k`` experts read ahead per layer call: one token's experts, as
``stream``'s window (what its reads overlap)."""

SWEEP_SHARE = 0.75
"""The share of a layer's experts a call needs for its next call to be read ahead."""


class RegionReadAhead:
    """One layer's read ahead of the layer after it in the pass (its ``following``, found
    per call: the layers are linked once they are all loaded)."""

    def __init__(
        self, layer: OffloadedLayer, following: Callable[[], OffloadedLayer | None]
    ) -> None:
        self.layer = layer
        self.following = following

    def stage(self) -> Stage:
        return Stage("region.read_ahead", "plan", self._plan)

    def _plan(self, call: DecodeCall) -> None:
        call.first_launch.add(self._read)

    def _read(self) -> None:
        nxt = self.following()
        if nxt is None or not sweeps(self.layer) or not sweeps(nxt):
            return
        expected = nxt.loader.last_needed
        assert expected is not None  # (a sweep was needed)
        nxt.loader.read_ahead(expected, nxt.stats.decode, READ_AHEAD_WINDOWS * nxt.top_k)


def sweeps(layer: OffloadedLayer) -> bool:
    """Whether the layer's last call (the running one, for the layer that runs) needed
    at least :data:`SWEEP_SHARE` of its experts."""
    needed = layer.loader.last_needed
    return needed is not None and len(needed) >= SWEEP_SHARE * layer.cache.num_experts
