"""Reads ahead through the shared region: the following layer's reads start while this
layer computes (issue 74: the disk never idles while a read is owed).

Where a batch needs more experts than a layer's own slots hold, its call reads the
missing ones into the shared region (:mod:`~vllm_specexpert.tiers.shared_region`).
Where a call needs nearly every expert (at least :data:`SWEEP_SHARE` of them: top-4 of
64 at 32 sequences or more), the next call of each layer needs nearly the same ones. So
before such a layer's launch the following layer's last demand, if it was such a call
too, is read ahead, in file order, into the rows the launch does not use (the split
keeps :func:`reserved_rows` of them beside a full sweep's missing experts): the disk
reads while the kernel runs, and what the following call then reads on demand is that
much less. Exactness is untouched: the following call still runs once every expert it
needs has landed, in one launch. Below that share a guess costs a read the call may not
need, so nothing is read ahead (docs/design.md: read ahead after every call that passed
its own slots, the miniature read 1.2x the bytes at one sequence, the first decode step
reading the prompt's experts).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.pipeline import DecodeCall, Stage

SWEEP_SHARE = 0.75
"""The share of a layer's experts a call needs for its next call to be read ahead."""

READ_AHEAD_FLOPS_PER_BYTE = 64
"""The expert kernel's FLOP/s over the disk's bytes/s, modeled: ``disk.read_ahead_rows:
"auto"`` keeps ``max_num_seqs * top_k / READ_AHEAD_FLOPS_PER_BYTE`` rows for reads ahead.
A bf16 expert's bytes are its FLOPs per token (2 of each a weight), so a launch of ``n``
tokens' ``top_k`` experts computes as long as ``n * top_k / ratio`` experts take to read.
On the issue-74 machines: 140-190 GFLOP/s against 2-2.8 GB/s (docs/benchmarks.md); the
stats' ``read_ahead_rows.hidden`` is the count measured as the engine runs."""


def reserved_rows(
    setting: int | Literal["auto"], max_num_seqs: int, top_k: int, num_experts: int
) -> int:
    """The rows a layer's shared region keeps for reads ahead (``disk.read_ahead_rows``):
    none where no call of ``max_num_seqs`` sequences needs :data:`SWEEP_SHARE` of the
    experts (nothing is read ahead there)."""
    if min(max_num_seqs * top_k, num_experts) < SWEEP_SHARE * num_experts:
        return 0
    if setting != "auto":
        return setting
    return min(math.ceil(max_num_seqs * top_k / READ_AHEAD_FLOPS_PER_BYTE), num_experts)


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
        nxt.loader.read_ahead(expected, nxt.stats.decode)


def sweeps(layer: OffloadedLayer) -> bool:
    """Whether the layer's last call (the running one, for the layer that runs) needed
    at least :data:`SWEEP_SHARE` of its experts."""
    needed = layer.loader.last_needed
    return needed is not None and len(needed) >= SWEEP_SHARE * layer.cache.num_experts
