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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.pipeline import DecodeCall, Stage
from vllm_specexpert.tiers.disk_reader import aligned_empty

SWEEP_SHARE = 0.75
"""The share of a layer's experts a call needs for its next call to be read ahead."""

PROBE_EXPERTS = 4
"""Experts a probe reads (at the reader's queue depth) and computes, each timed at its
best of two rounds."""


def reserved_rows(
    setting: int | Literal["auto"],
    max_num_seqs: int,
    top_k: int,
    num_experts: int,
    measured: Callable[[], float | None] = lambda: None,
) -> int:
    """The rows a layer's shared region keeps for reads ahead (``disk.read_ahead_rows``):
    none where no call of ``max_num_seqs`` sequences needs :data:`SWEEP_SHARE` of the
    experts (nothing is read ahead there); ``"auto"``: those worth keeping,
    ``measured()`` (:meth:`LaunchProbe.rows`), none where nothing could be measured (no
    gain was measured without one); at most the layer's experts."""
    if min(max_num_seqs * top_k, num_experts) < SWEEP_SHARE * num_experts:
        return 0
    if setting != "auto":
        return setting
    reads = measured()
    return 0 if reads is None else min(math.ceil(reads), num_experts)


@dataclass(frozen=True)
class LaunchProbe:
    """What :func:`probe_launch` timed, in seconds: ``count`` experts read alone and beside
    the kernel, and the kernel on their shares of a launch alone and beside the reads."""

    count: int
    read_s: float
    read_beside_s: float
    kernel_s: float
    kernel_beside_s: float

    def rows(self, num_experts: int, layers: int) -> float:
        """The reads a launch on all ``num_experts`` experts hides (stretched as the
        kernel is beside reads), where hiding them saves more time than the stretch and
        the rows' own cost (each row kept takes ``1 / (layers - 1)`` of an own slot from
        every layer: as many more reads a layer); else 0. On a machine whose cores the
        kernel fills, the reads' checksums slow it by about what they hide."""
        launch = num_experts / self.count * self.kernel_s
        stretched = launch * self.kernel_beside_s / self.kernel_s
        read, read_beside = self.read_s / self.count, self.read_beside_s / self.count
        hidden = stretched / read_beside
        saved = hidden * read * (1 - 1 / max(layers - 1, 1)) - (stretched - launch)
        return hidden if saved > 0 else 0.0


def probe_launch(
    layer: OffloadedLayer,
    max_num_seqs: int,
    hidden_size: int,
    clock: Callable[[], float] = time.perf_counter,
) -> LaunchProbe | None:
    """Times, now, :data:`PROBE_EXPERTS` of ``layer``'s experts read from the slow tier
    into scratch rows, and the layer's kernel on them with each one's share of a launch
    of ``max_num_seqs`` tokens needing every expert (``max_num_seqs * top_k / E`` tokens
    each): each alone (the best of two), then both at once, as a read ahead runs beside
    a launch (the reads in a thread, into other rows; the kernel here until they end).
    ``None`` where the layer's kernel cannot run here (no host kernel: CUDA), the hidden
    size is unknown, or an expert probed cannot be read (it fails only the requests that
    need it, later)."""
    kernel, experts = layer.host_kernel, layer.experts
    if kernel is None or hidden_size <= 0:
        return None
    count = min(PROBE_EXPERTS, experts.num_experts)
    rows = np.arange(count)
    shapes = experts.slot_shapes.items()
    scratch, other = (
        {name: aligned_empty((count, *shape), dtype) for name, (shape, dtype) in shapes}
        for _ in range(2)
    )
    dtype = next(iter(experts.slot_shapes.values()))[1]
    tokens = max(1, math.ceil(max_num_seqs * layer.top_k / experts.num_experts)) * count
    x = torch.randn(tokens, hidden_size, dtype=dtype)
    weights = torch.ones(tokens, 1, dtype=torch.float32)
    ids = torch.from_numpy(np.arange(tokens, dtype=np.int32) % count)[:, None]

    def timed(work: Callable[[], object]) -> float:
        started = clock()
        work()
        return clock() - started

    read_s = kernel_s = math.inf
    read_beside: list[float | None] = []

    def read_into(rows_of: dict[str, torch.Tensor]) -> float | None:
        try:
            return timed(lambda: experts.copy_into(rows, rows, rows_of))
        except Exception:  # noqa: BLE001 - an unreadable expert: its requests fail later
            return None

    for _ in range(2):
        read = read_into(scratch)
        if read is None:
            return None
        read_s = min(read_s, read)
        kernel_s = min(kernel_s, timed(lambda: kernel(x, weights, ids, scratch)))
    reader = threading.Thread(target=lambda: read_beside.append(read_into(other)))
    launches: list[float] = []
    reader.start()
    while reader.is_alive() or not launches:
        launches.append(timed(lambda: kernel(x, weights, ids, scratch)))
    reader.join()
    beside = read_beside[0]
    if beside is None:
        return None
    return LaunchProbe(count, read_s, beside, kernel_s, sum(launches) / len(launches))


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
        needed = self.layer.loader.last_needed
        if needed is not None and not self.layer.cache.capacity_for(needed):
            return  # (its call runs in token groups: the groups after this launch need every row)
        expected = nxt.loader.last_needed
        assert expected is not None  # (a sweep was needed)
        nxt.loader.read_ahead(expected, nxt.stats.decode)


def sweeps(layer: OffloadedLayer) -> bool:
    """Whether the layer's last call (the running one, for the layer that runs) needed
    at least :data:`SWEEP_SHARE` of its experts."""
    needed = layer.loader.last_needed
    return needed is not None and len(needed) >= SWEEP_SHARE * layer.cache.num_experts
