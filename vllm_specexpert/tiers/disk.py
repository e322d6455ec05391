"""The disk tier: routed experts read whole from an expert pack (:mod:`.expert_pack`),
for models whose experts do not fit in memory.

A :class:`DiskExperts` is one layer's slow tier when the disk is on: what the link copies
into slots is read from the pack at the reader's queue depth, into page-aligned buffers
that are reused, checked against its record's checksum at every read (a record that
fails never enters a slot), and
turned into what a slot holds by the layer's decoder (the CPU kernel's prepacked layout,
made on arrival). Nothing of a layer's experts stays in memory outside the slots: on the
CPU build the slots are the only tier above the disk.

:class:`Disk` is the tier itself, shared by the layers of one engine: the pack, one
reader (one queue of reads for the whole model, as one disk serves them), the buffers,
and the counters (reads, bytes, seconds waited, records checked).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.log import init_logger
from vllm_specexpert.tiers.disk_reader import (
    DiskFile,
    DiskReader,
    aligned_buffer,
)
from vllm_specexpert.tiers.expert_pack import (
    DTYPES,
    FIELD,
    RECORDS_FILE,
    CorruptRecord,
    ExpertPack,
    PackLayer,
)
from vllm_specexpert.tiers.pack_lock import PackBusy, PackLock
from vllm_specexpert.tiers.store import (
    ExpertDecoder,
    ExpertsUnreadable,
    SlotForm,
    SlotShapes,
    stage,
)

logger = init_logger(__name__)


@dataclass
class DiskStats:
    reads: int = 0
    bytes: int = 0
    wait_s: float = 0.0
    """Seconds the copies spent waiting for reads (real I/O), and for the decoding of
    what was read, which runs on the reader's threads as each read arrives."""
    checked: int = 0
    """Reads whose checksum was verified (every read that arrived)."""
    failed: int = 0
    """Expert reads that failed (an I/O error, a record whose checksum failed)."""


class Disk:
    """The pack one engine reads experts from, its reader and buffers (module doc)."""

    def __init__(
        self, pack: ExpertPack, depth: int, direct: bool = True, lock: PackLock | None = None
    ) -> None:
        self.pack = pack
        self.lock = lock
        self.reader = DiskReader(DiskFile(pack.path / RECORDS_FILE, direct=direct), depth)
        self.stats = DiskStats()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    @property
    def direct(self) -> bool:
        return self.reader.file.direct

    def where(self) -> str:
        how = "O_DIRECT" if self.direct else "through the page cache"
        return f"on disk ({self.pack.path}, {how}, queue depth {self.reader.depth})"

    def layer(self, name: str, decoder: ExpertDecoder | None) -> DiskExperts:
        """Layer ``name``'s experts on this disk."""
        return DiskExperts(self, self.record_of(name), decoder)

    def record_of(self, name: str) -> PackLayer:
        """Layer ``name``'s records in the pack (refused when the pack has none)."""
        layer = self.pack.layers.get(name)
        if layer is None:
            raise SpecExpertConfigError(
                FIELD,
                f"{self.pack.path} has no experts of {name} (a pack of another model?)",
                f"remove {self.pack.path}: the plugin makes the pack again on the next start",
            )
        return layer

    def read(self, layer: PackLayer, experts: np.ndarray) -> list[torch.Tensor]:
        """The records of ``experts`` (distinct ids of ``layer``), each in a buffer the
        caller gives back with :meth:`release` (see :meth:`read_each`)."""
        return self._read(layer, experts, None)

    def read_each(
        self,
        layer: PackLayer,
        experts: np.ndarray,
        arrived: Callable[[int, torch.Tensor], None],
    ) -> None:
        """Read the records of ``experts``, calling ``arrived(i, buffer)`` on each as
        soon as it is read and checked (``i``: its position in ``experts``), on the
        reader's thread that read it: what is done with one record overlaps the reads
        of the others and runs on up to ``queue_depth`` cores. At most twice the queue
        depth are read at a time, so that a large transfer (a warm start: a layer's
        every slot) holds that many buffers, not one per expert; the buffers are then
        reused. One :class:`ExpertsUnreadable` names every expert that failed."""
        window = 2 * self.reader.depth
        failed: list[int] = []
        first: ExpertsUnreadable | None = None
        for start in range(0, len(experts), window):

            def shifted(i: int, buffer: torch.Tensor, start: int = start) -> None:
                arrived(start + i, buffer)

            try:
                self.release(self._read(layer, experts[start : start + window], shifted))
            except ExpertsUnreadable as error:
                failed += error.experts
                first = first or error
        if first is not None:
            raise ExpertsUnreadable(layer.name, sorted(failed), first.cause) from first.__cause__

    def _read(
        self,
        layer: PackLayer,
        experts: np.ndarray,
        arrived: Callable[[int, torch.Tensor], None] | None,
    ) -> list[torch.Tensor]:
        """All reads are queued at once, so the reader keeps its queue depth. Every read
        is waited for, failed or not (a buffer must not be reused while a read still
        fills it); each record is checked against its CRC-32 at its first read. The
        experts whose read, check or ``arrived`` failed are named one by one in one
        :class:`ExpertsUnreadable`, raised once all are done (the buffers released)."""
        ids = experts.tolist()
        buffers = [self._buffer(layer.record_bytes) for _ in ids]

        def then(i: int) -> None:
            error = self._check(layer, ids[i], buffers[i])
            if error is not None:
                raise error
            if arrived is not None:
                arrived(i, buffers[i])

        started = time.perf_counter()
        jobs = []
        for i, expert in enumerate(ids):
            offset, length = layer.record(expert)
            jobs.append(self.reader.submit(buffers[i], offset, length, partial(then, i)))
        errors = {
            expert: error
            for expert, job in zip(ids, jobs, strict=True)
            if (error := job.exception()) is not None
        }
        with self._lock:
            self.stats.reads += len(ids)
            self.stats.bytes += len(ids) * layer.data_bytes
            self.stats.wait_s += time.perf_counter() - started
            self.stats.failed += len(errors)
        if errors:
            self.release(buffers)
            first = next(iter(errors.values()))
            raise ExpertsUnreadable(
                layer.name, sorted(errors), f"{type(first).__name__}: {first}"
            ) from first
        return buffers

    def _check(self, layer: PackLayer, expert: int, buffer: torch.Tensor) -> BaseException | None:
        """The record's checksum, at every read: ``CorruptRecord`` if it fails."""
        try:
            self.pack.check_record(layer, expert, buffer)
        except CorruptRecord as corrupt:
            return corrupt
        with self._lock:
            self.stats.checked += 1
        return None

    def _buffer(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return aligned_buffer(nbytes)

    def release(self, buffers: list[torch.Tensor]) -> None:
        """Give buffers back: up to twice the queue depth of each size are kept for
        the next reads, the others unmapped (a large gather's buffers would otherwise
        stay, outside every budget)."""
        keep = 2 * self.reader.depth
        with self._lock:
            for buffer in buffers:
                free = self._free.setdefault(buffer.numel(), [])
                if len(free) < keep:
                    free.append(buffer)

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = DiskStats()
        self.reader.stats.reset()

    def stats_dict(self) -> dict:
        """The disk's counters: reads, bytes, seconds the copies waited for them, the
        throughput the disk gave while it was read (``busy``: at least one read in
        flight) and while a copy waited, the records checked and the reads that failed."""
        stats, reader = self.stats, self.reader.stats
        return {
            "path": str(self.pack.path),
            "direct": self.direct,
            "queue_depth": self.reader.depth,
            "reads": stats.reads,
            "bytes": stats.bytes,
            "wait_s": stats.wait_s,
            "waited_gbps": stats.bytes / stats.wait_s / 1e9 if stats.wait_s else 0.0,
            "busy_s": reader.busy_s,
            "busy_gbps": reader.throughput_gbps,
            "checked": stats.checked,
            "failed": stats.failed,
        }

    def close(self) -> None:
        self.reader.close()
        if self.lock is not None:
            self.lock.release()


class DiskExperts(SlotForm):
    """One layer's routed experts in the disk tier: the slow tier's interface
    (:class:`~vllm_specexpert.tiers.store.ExpertSource`) over the pack's records."""

    def __init__(self, disk: Disk, layer: PackLayer, decoder: ExpertDecoder | None) -> None:
        self.disk = disk
        self.record = layer
        self.name = layer.name
        self.decoder = decoder
        self.num_experts = layer.num_experts
        self.expert_nbytes = layer.data_bytes
        """Bytes of one expert as read (the record's data)."""
        self.num_tensors = len(layer.tensors)

    @property
    def packed_format(self) -> str | None:
        return None  # (a pack holds the checkpoint's bf16/fp16 experts)

    def held_shapes(self) -> SlotShapes:
        return {t.name: (tuple(t.shape), DTYPES[t.dtype]) for t in self.record.tensors}

    @property
    def staging_nbytes(self) -> int:
        """A transfer's window of read buffers (:meth:`Disk.read_each`) and, per reader
        thread, an expert being decoded."""
        depth = self.disk.reader.depth
        return 2 * depth * self.expert_nbytes + depth * self.slot_nbytes

    def gather(self, experts: np.ndarray) -> dict[str, torch.Tensor]:
        """``experts``' tensors as the pack holds them, ``[n, ...]`` each (read now)."""
        buffers = self.disk.read(self.record, experts)
        try:
            parts = [self.disk.pack.unpack(self.record, buffer) for buffer in buffers]
            return {t.name: torch.stack([p[t.name] for p in parts]) for t in self.record.tensors}
        finally:
            self.disk.release(buffers)

    def decoded(self, experts: np.ndarray | slice) -> dict[str, torch.Tensor]:
        """Slot contents of ``experts`` (ids or a slice of them)."""
        if isinstance(experts, slice):
            experts = np.arange(self.num_experts)[experts]
        packed = self.gather(np.asarray(experts))
        return packed if self.decoder is None else self.decoder(packed)

    def copy_into(
        self,
        experts: np.ndarray,
        slots: np.ndarray,
        destinations: dict[str, torch.Tensor],
        device: torch.device | None = None,
    ) -> None:
        """On the host: each expert decoded into its slot as soon as its read arrives, on
        the reader's thread, while the others are still being read (the decode, the CPU
        kernel's prepacking, about as slow per byte as this disk, overlaps the reads and
        runs on several cores; no stacked copy). Onto ``device``: read, moved and decoded
        there (:func:`~vllm_specexpert.tiers.store.stage`)."""
        if device is not None:
            stage(self, experts, slots, destinations, device)
            return
        targets = slots.tolist()

        def arrived(i: int, buffer: torch.Tensor) -> None:
            one = {k: t.unsqueeze(0) for k, t in self.disk.pack.unpack(self.record, buffer).items()}
            decoded = one if self.decoder is None else self.decoder(one)
            for key, tensor in decoded.items():
                destinations[key][targets[i]].copy_(tensor[0])

        self.disk.read_each(self.record, np.asarray(experts), arrived)


def open_disk(path: str, model: str, queue_depth: int, direct: bool) -> Disk:
    """The disk tier of a worker: the pack, locked shared for as long as it is read
    (a ``specexpert pack`` started meanwhile is refused), checked again (the caller's
    check may be a while ago), and a reader."""
    lock = PackLock(path)
    try:
        lock.acquire(exclusive=False, wait=False)
    except PackBusy as busy:
        raise SpecExpertConfigError(
            FIELD, f"{busy}, which is writing it", "wait for it to finish, then start again"
        ) from None
    try:
        return Disk(ExpertPack(path, model=model), queue_depth, direct, lock)
    except BaseException:
        lock.release()
        raise
