"""The disk tier: routed experts read whole from an expert pack (:mod:`.expert_pack`),
for models whose experts do not fit in memory (docs/design.md, "The disk tier").

:class:`DiskExperts` is one layer's slow tier: records read at the reader's queue depth
into reused page-aligned buffers, checksummed at every read, decoded into slots on
arrival; nothing stays in memory outside the slots. :class:`Disk` is shared by the
layers of one engine: the pack, one reader (one disk), the buffers and the counters.
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
    """Seconds copies waited for reads, including the decoding on the reader's threads."""
    checked: int = 0
    """Reads whose checksum was verified."""
    failed: int = 0
    """Expert reads that failed (I/O error or bad checksum)."""


class Disk:
    """The pack one engine reads experts from, its reader and buffers."""

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
        """The records of ``experts``, in buffers the caller gives back with :meth:`release`."""
        return self._read(layer, experts, None)

    def read_each(
        self,
        layer: PackLayer,
        experts: np.ndarray,
        arrived: Callable[[int, torch.Tensor], None],
    ) -> None:
        """Call ``arrived(i, buffer)`` (``i``: position in ``experts``) on each record as
        it is read and checked, on the reader's thread, so the work overlaps the other
        reads. At most twice the queue depth in flight, so a warm start's transfer holds
        that many buffers, not one per expert. One :class:`ExpertsUnreadable` names
        every expert that failed."""
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
        """All reads queued at once (the reader keeps its depth), all waited for, failed
        or not (a buffer must not be reused while a read fills it); failures are raised
        together once all are done."""
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
        """Keep up to twice the queue depth of each size for reuse, unmap the others
        (a large gather's buffers would otherwise stay, outside every budget)."""
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
        """``busy``: time with at least one read in flight."""
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
    """One layer's experts in the pack, as an :class:`~vllm_specexpert.tiers.store.ExpertSource`."""

    def __init__(self, disk: Disk, layer: PackLayer, decoder: ExpertDecoder | None) -> None:
        self.disk = disk
        self.record = layer
        self.name = layer.name
        self.decoder = decoder
        self.num_experts = layer.num_experts
        self.expert_nbytes = layer.data_bytes
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
        buffers = self.disk.read(self.record, experts)
        try:
            parts = [self.disk.pack.unpack(self.record, buffer) for buffer in buffers]
            return {t.name: torch.stack([p[t.name] for p in parts]) for t in self.record.tensors}
        finally:
            self.disk.release(buffers)

    def decoded(self, experts: np.ndarray | slice) -> dict[str, torch.Tensor]:
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
        """On the host: each expert decoded into its slot on the reader's thread as its
        read arrives (the decode, about as slow per byte as the disk, overlaps the
        reads). Onto ``device``: :func:`~vllm_specexpert.tiers.store.stage`."""
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
    """The pack, locked shared while read (a ``specexpert pack`` meanwhile is refused)
    and checked again (the caller's check may be old), with a reader."""
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
