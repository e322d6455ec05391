"""The disk tier's host cache on CUDA: experts read from the expert pack into pinned host
rows, and copied to the device slots from there (docs/design.md, "The disk tier").

The device slots (``budget``) hold the hottest experts; the host rows
(``disk.host_cache``, sized by the same function from the host's free memory) hold the
next ones, least recently used out, so a device miss is a DMA from pinned memory when
the rows hold the expert and a disk read into a row first when they do not. The CPU
build has none for the target: its slots are in host memory, the only tier above the
disk. On either build the ``lookahead`` draft's INT4 experts are read into rows of their
own (``lookahead.draft_cache``, not pinned) and decoded from there into its slots.

A row is not overwritten while a copy out of it may still run: each copy records an
event on the stream it was issued on, and a row's next read waits for it.

Not run on a GPU: this machine has none. The CPU build's tests run it with the host as
the "device" (synchronous copies, no events); ``make gpu-check`` lists it among what a
GPU run must check.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from vllm_specexpert.stats import Counters, counter
from vllm_specexpert.tiers.disk_reader import aligned_empty
from vllm_specexpert.tiers.pack_experts import PackExperts
from vllm_specexpert.tiers.store import ExpertDecoder, ExpertsUnreadable, SlotShapes


class CopyDone(Protocol):
    """What a copy out of a row leaves behind: ``torch.cuda.Event`` on CUDA."""

    def synchronize(self) -> None: ...


@dataclass
class HostCacheStats(Counters):
    hits: int = counter("Experts a copy to the device found in the host rows.")
    misses: int = counter("Experts read from the disk into a row first.")


class HostRows:
    """One layer's host rows: a tensor ``[rows, ...]`` per expert tensor (page-aligned,
    so ``O_DIRECT`` lands in them; pinned on CUDA), which expert each row holds, and when
    each was last used."""

    def __init__(self, shapes: SlotShapes, rows: int, pinned: bool) -> None:
        self.tensors = {
            name: aligned_empty((rows, *shape), dtype) for name, (shape, dtype) in shapes.items()
        }
        if pinned:  # (registered, not allocated pinned: the rows stay page-aligned)
            cudart = torch.cuda.cudart()
            for tensor in self.tensors.values():
                cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.itemsize, 0)
        self.pinned = pinned
        self.owner = np.full(rows, -1, dtype=np.int64)
        self.row_of: dict[int, int] = {}
        self.last_use = np.zeros(rows, dtype=np.int64)
        self.copy_done: list[CopyDone | None] = [None] * rows
        self.clock = 0
        self.stats = HostCacheStats()
        self.lock = threading.Lock()
        """Held for a whole copy: a row read for one copy is not taken by another."""

    @property
    def num_rows(self) -> int:
        return len(self.owner)

    def hold(self, experts: np.ndarray, reader: PackExperts) -> np.ndarray:
        """The rows of ``experts`` (distinct, at most :attr:`num_rows`): those held, and
        the others read from the disk into the least recently used rows not among them.
        An expert whose read fails leaves its row empty (:class:`ExpertsUnreadable`)."""
        self.clock += 1
        rows = np.array([self.row_of.get(e, -1) for e in experts.tolist()], dtype=np.int64)
        missing = np.flatnonzero(rows < 0)
        self.stats.hits += len(experts) - len(missing)
        self.stats.misses += len(missing)
        if len(missing):
            free = np.ones(self.num_rows, dtype=bool)
            free[rows[rows >= 0]] = False
            candidates = np.flatnonzero(free)
            taken = candidates[np.argsort(self.last_use[candidates], kind="stable")][: len(missing)]
            for row in taken.tolist():
                self._empty(row)
            rows[missing] = taken
            try:
                reader.read_rows(experts[missing], self.tensors, taken.tolist())
            except ExpertsUnreadable as error:
                failed = set(error.experts)
                self._own(experts[missing], taken, skip=failed)
                raise
            self._own(experts[missing], taken)
        self.last_use[rows] = self.clock
        return rows

    def copy_to(
        self,
        rows: np.ndarray,
        slots: np.ndarray,
        destinations: dict[str, torch.Tensor],
        device: torch.device | None,
        decoder: ExpertDecoder | None = None,
    ) -> None:
        """Copy ``rows`` into ``slots`` (packed rows through their ``decoder``): issued
        on ``device``'s current stream (a row's next read waits for it), or at once on
        the host."""
        if decoder is not None:
            index = torch.from_numpy(rows.astype(np.int64))
            packed = {name: t.index_select(0, index) for name, t in self.tensors.items()}
            if device is not None:
                packed = {name: t.to(device, non_blocking=True) for name, t in packed.items()}
            index = torch.from_numpy(slots.astype(np.int64))
            for name, tensor in decoder(packed).items():
                pool = destinations[name]
                pool.index_copy_(0, index.to(pool.device), tensor)
            return  # (what was read is a copy: the rows are free at once)
        for name, pool in destinations.items():
            source = self.tensors[name]
            for row, slot in zip(rows.tolist(), slots.tolist(), strict=True):
                pool[slot].copy_(source[row], non_blocking=device is not None)
        if device is not None and device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            for row in rows.tolist():
                self.copy_done[row] = done

    def release(self) -> None:
        """Wait for the copies out, and unpin the rows (before they are freed)."""
        for row in range(self.num_rows):
            self._wait_copy(row)
        if self.pinned:
            cudart = torch.cuda.cudart()
            for tensor in self.tensors.values():
                cudart.cudaHostUnregister(tensor.data_ptr())
            self.pinned = False

    def _own(self, experts: np.ndarray, rows: np.ndarray, skip: Collection[int] = ()) -> None:
        for expert, row in zip(experts.tolist(), rows.tolist(), strict=True):
            if expert not in skip:
                self.owner[row] = expert
                self.row_of[expert] = row

    def _empty(self, row: int) -> None:
        """Make ``row`` free to read into: its expert gone, its last copy out done."""
        self._wait_copy(row)
        expert = int(self.owner[row])
        if expert >= 0:
            del self.row_of[expert]
            self.owner[row] = -1

    def _wait_copy(self, row: int) -> None:
        done = self.copy_done[row]
        if done is not None:
            done.synchronize()
            self.copy_done[row] = None


class HostCachedExperts(PackExperts):
    """A pack layer's experts seen through its host rows: copies to the device read
    what the rows lack from the disk first, in runs of at most the rows' count."""

    def __init__(self, experts: PackExperts, rows: HostRows) -> None:
        super().__init__(experts.pack, experts.record, experts.decoder)
        self.reader = experts
        """What reads the rows' misses from the disk (:class:`~.disk.DiskExperts`)."""
        self.rows = rows

    @property
    def staging_nbytes(self) -> int:
        return 0  # (the disk's buffers are host memory, not the device's the budget sizes)

    @property
    def memory_nbytes(self) -> int:
        return sum(t.numel() * t.itemsize for t in self.rows.tensors.values())

    def copy_into(
        self,
        experts: np.ndarray,
        slots: np.ndarray,
        destinations: dict[str, torch.Tensor],
        device: torch.device | None = None,
    ) -> None:
        experts, slots = np.asarray(experts), np.asarray(slots)
        size = self.rows.num_rows
        with self.rows.lock:
            for start in range(0, len(experts), size):
                run = slice(start, start + size)
                rows = self.rows.hold(experts[run], self.reader)
                self.rows.copy_to(rows, slots[run], destinations, device, self.decoder)


class HostCache:
    """The host rows of every layer of one disk tier, ``rows_per_layer`` each."""

    def __init__(self, rows_per_layer: int, pinned: bool) -> None:
        self.rows_per_layer = rows_per_layer
        self.pinned = pinned
        self.layers: dict[str, HostRows] = {}

    def wrap(self, experts: PackExperts) -> HostCachedExperts:
        """``experts`` read through rows of their own."""
        rows = HostRows(experts.held_shapes(), self.rows_per_layer, self.pinned)
        self.layers[experts.name] = rows
        return HostCachedExperts(experts, rows)

    def where(self) -> str:
        """For the start line."""
        pinned = "pinned" if self.pinned else "not pinned"
        return f"host cache {self.rows_per_layer} experts per layer ({pinned})"

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.itemsize for rows in self.layers.values() for t in rows.tensors.values()
        )

    def stats_dict(self) -> dict:
        hits = sum(rows.stats.hits for rows in self.layers.values())
        misses = sum(rows.stats.misses for rows in self.layers.values())
        return {
            "rows_per_layer": self.rows_per_layer,
            "bytes": self.nbytes,
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        }

    def reset_stats(self) -> None:
        for rows in self.layers.values():
            rows.stats.reset()

    def close(self) -> None:
        for rows in self.layers.values():
            rows.release()


__all__ = ["HostCache", "HostCachedExperts", "HostRows"]
