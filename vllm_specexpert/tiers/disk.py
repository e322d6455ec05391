"""The disk tier: routed experts read from an expert pack (:mod:`.expert_pack`), for
models whose experts do not fit in memory (docs/design.md, "The disk tier").

:class:`DiskExperts` is one layer's slow tier: each expert tensor read, at the reader's
queue depth, straight into the slot the kernel reads it from (the pack holds the
kernel's form: nothing is decoded on arrival), checksummed at every read; nothing stays
in memory outside the slots. :class:`Disk` is shared by the layers of one engine: the
pack, one reader (one disk) and the counters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import numpy as np
import torch

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.log import init_logger
from vllm_specexpert.stats import Counters, counter, seconds
from vllm_specexpert.tiers.disk_reader import DiskFile, DiskReader
from vllm_specexpert.tiers.expert_pack import (
    DRAFT_PREFIX,
    FIELD,
    RECORDS_FILE,
    ExpertPack,
    PackLayer,
    PackTensor,
)
from vllm_specexpert.tiers.host_cache import HostCache, HostCachedExperts
from vllm_specexpert.tiers.mapped import MappedExperts, MappedPack, MappingRefused
from vllm_specexpert.tiers.pack_experts import PackExperts
from vllm_specexpert.tiers.pack_lock import NotALockFile, PackBusy, PackLock
from vllm_specexpert.tiers.store import ExpertDecoder, stage

logger = init_logger(__name__)


@dataclass
class DiskStats(Counters):
    """The slots residency's reads, as the layers' copies asked for them."""

    reads: int = counter("Experts read from the disk tier's pack.")
    bytes: int = counter("Bytes read from the disk tier's pack.")
    wait_s: float = seconds(
        "Seconds copies waited for reads, including the checksums on the reader's threads."
    )
    checked: int = counter("Expert reads whose every tensor matched its checksum.")
    failed: int = counter("Expert reads that failed (I/O error or bad checksum).")


class Disk:
    """The pack one engine reads experts from, its reader and, for the mapped residency,
    its mapping: the slow tier ``disk`` (:mod:`.slow_tiers`)."""

    name: ClassVar[str] = "disk"

    @classmethod
    def configured(cls, config: SpecExpertConfig, model: str) -> bool:
        return config.disk is not None

    @classmethod
    def open(cls, config: SpecExpertConfig, model: str) -> Disk:
        settings = config.disk
        assert settings is not None  # (opened where configured)
        return open_disk(
            settings.path,
            model,
            settings.queue_depth,
            settings.direct,
            mapped=settings.residency == "mapped",
        )

    def __init__(
        self,
        pack: ExpertPack,
        depth: int,
        direct: bool = True,
        lock: PackLock | None = None,
        mapped: bool = False,
    ) -> None:
        self.pack = pack
        self.lock = lock
        self.reader = DiskReader(DiskFile(pack.path / RECORDS_FILE, direct=direct), depth)
        self.stats = DiskStats()
        self._lock = threading.Lock()
        self.mapping: MappedPack | None = None
        """The mapped residency's mapping (``None``: slots)."""
        self.mapping_refused: str | None = None
        """Why the mapping asked for was not made (the slots are used instead)."""
        self.host_cache: HostCache | None = None
        """CUDA: the pinned host rows the layers' experts are read into and copied to
        the device from (set before the first :meth:`layer`)."""
        self.draft_cache: HostCache | None = None
        """``lookahead``: the host rows the draft's packed experts are read into and
        decoded into its slots from (set before the draft's first :meth:`layer`)."""
        if mapped:
            try:
                self.mapping = MappedPack(pack)
            except MappingRefused as refused:
                self.mapping_refused = str(refused)
                logger.warning(
                    "specexpert: disk.residency 'mapped' refused, using slots: %s", refused
                )

    @property
    def direct(self) -> bool:
        return self.reader.file.direct

    def where(self) -> str:
        if self.mapping is not None:
            return f"on disk ({self.pack.path}, mapped: the page cache is the cache)"
        how = "O_DIRECT" if self.direct else "through the page cache"
        refused = f"; mapping refused: {self.mapping_refused}" if self.mapping_refused else ""
        host = "" if self.host_cache is None else f"; {self.host_cache.where()}"
        return f"on disk ({self.pack.path}, {how}, queue depth {self.reader.depth}{refused}{host})"

    def layer(
        self, name: str, decoder: ExpertDecoder | None = None
    ) -> DiskExperts | MappedExperts | HostCachedExperts:
        """Layer ``name``'s experts: the target's, or the draft's (read through
        :attr:`draft_cache`; with their ``decoder``, decoded into the draft's slots)."""
        if name.startswith(DRAFT_PREFIX):
            packed = DiskExperts(self, self.record_of(name), decoder)
            return packed if self.draft_cache is None else self.draft_cache.wrap(packed)
        if self.mapping is not None:
            return MappedExperts(self.mapping, self.record_of(name))
        experts = DiskExperts(self, self.record_of(name))
        return experts if self.host_cache is None else self.host_cache.wrap(experts)

    def record_of(self, name: str) -> PackLayer:
        """Layer ``name``'s regions in the pack (refused when the pack has none)."""
        layer = self.pack.layers.get(name)
        if layer is None:
            raise SpecExpertConfigError(
                FIELD,
                f"{self.pack.path} has no experts of {name} (a pack of another model?)",
                f"remove {self.pack.path}: the plugin makes the pack again on the next start",
            )
        return layer

    def read(
        self,
        layer: PackLayer,
        experts: np.ndarray,
        destinations: Mapping[str, torch.Tensor],
        rows: Sequence[int],
    ) -> None:
        """Read expert ``experts[i]``'s tensors into row ``rows[i]`` of ``destinations``
        (``[n, ...]`` per tensor name), each checked against its checksum. Every read is
        queued at once (the reader keeps its depth) and waited for, failed or not; one
        :class:`ExpertsUnreadable` then names every expert that failed (its rows hold
        no expert)."""
        ids = experts.tolist()
        started = time.perf_counter()
        jobs = []
        for expert, row in zip(ids, rows, strict=True):
            for tensor in layer.tensors:
                target = destinations[tensor.name][row].reshape(-1).view(torch.uint8)
                check = partial(self._check, layer, tensor, expert, target)
                jobs.append(
                    (expert, self.reader.submit(target, tensor.at(expert), tensor.nbytes, check))
                )
        errors: dict[int, BaseException] = {}
        for expert, job in jobs:
            if (error := job.exception()) is not None:
                errors.setdefault(expert, error)
        with self._lock:
            self.stats.reads += len(ids)
            self.stats.bytes += len(ids) * layer.expert_nbytes
            self.stats.wait_s += time.perf_counter() - started
            self.stats.failed += len(errors)
            self.stats.checked += len(ids) - len(errors)
        if errors:
            raise self.pack.unreadable(
                layer.name, {e: f"{type(error).__name__}: {error}" for e, error in errors.items()}
            ) from next(iter(errors.values()))

    def _check(self, layer: PackLayer, tensor: PackTensor, expert: int, data: torch.Tensor) -> None:
        self.pack.check_read(layer, tensor, expert, data.numpy().data)

    def reset_stats(self) -> None:
        with self._lock:
            self.stats.reset()
        self.reader.stats.reset()
        if self.mapping is not None:
            self.mapping.reset_stats()
        for cache in (self.host_cache, self.draft_cache):
            if cache is not None:
                cache.reset_stats()

    def stats_dict(self) -> dict:
        """``busy``: time with at least one read in flight. Mapped: what launches had
        populated (tensors with pages outside the page cache, their bytes, the wait), the
        experts checked against their checksums and the time it took, and what
        prefetches read ahead (experts, bytes)."""
        if self.mapping is not None:
            return {
                "path": str(self.pack.path),
                "residency": "mapped",
                **self.mapping.stats.to_dict(),
                **self._draft_stats(),
            }
        stats, reader = self.stats, self.reader.stats
        return {
            "path": str(self.pack.path),
            "residency": "slots",
            "direct": self.direct,
            "queue_depth": self.reader.depth,
            **stats.to_dict(),
            "waited_gbps": stats.bytes / stats.wait_s / 1e9 if stats.wait_s else 0.0,
            "busy_s": reader.busy_s,
            "busy_gbps": reader.throughput_gbps,
            **({} if self.host_cache is None else {"host_cache": self.host_cache.stats_dict()}),
            **self._draft_stats(),
        }

    def _draft_stats(self) -> dict:
        """``draft_cache``: the draft's host rows (its reads are the disk's too)."""
        return {} if self.draft_cache is None else {"draft_cache": self.draft_cache.stats_dict()}

    def close(self) -> None:
        self.reader.close()
        if self.mapping is not None:
            self.mapping.close()
        for cache in (self.host_cache, self.draft_cache):
            if cache is not None:
                cache.close()
        if self.lock is not None:
            self.lock.release()


class DiskExperts(PackExperts):
    """One layer's experts in the pack, read into slots, as an
    :class:`~vllm_specexpert.tiers.store.ExpertSource`."""

    def __init__(self, disk: Disk, layer: PackLayer, decoder: ExpertDecoder | None = None) -> None:
        super().__init__(disk.pack, layer, decoder)
        self.disk = disk

    @property
    def staging_nbytes(self) -> int:
        """What reads that cannot land in place (an unaligned tensor under ``O_DIRECT``)
        take beside the slots: a bounce buffer per reader thread."""
        file = self.disk.reader.file
        bounced = [t.nbytes for t in self.record.tensors if file.bounces(t.offset, t.nbytes)]
        return self.disk.reader.depth * file.bounce_nbytes(max(bounced)) if bounced else 0

    def copy_into(
        self,
        experts: np.ndarray,
        slots: np.ndarray,
        destinations: dict[str, torch.Tensor],
        device: torch.device | None = None,
    ) -> None:
        """On the host: each tensor read into its slot. Onto ``device``, or packed:
        gathered on the host, moved and decoded (:func:`~vllm_specexpert.tiers.store.stage`)."""
        if device is not None or self.decoder is not None:
            stage(self, experts, slots, destinations, device)
            return
        self.read_rows(np.asarray(experts), destinations, slots.tolist())

    def read_rows(
        self, experts: np.ndarray, destinations: dict[str, torch.Tensor], rows: list[int]
    ) -> None:
        self.disk.read(self.record, experts, destinations, rows)


def open_disk(path: str, model: str, queue_depth: int, direct: bool, mapped: bool = False) -> Disk:
    """The pack, locked shared while read (a ``specexpert pack`` meanwhile is refused)
    and checked again (the caller's check may be old), with a reader."""
    lock = PackLock(path)
    try:
        lock.acquire(exclusive=False, wait=False)
    except PackBusy as busy:
        raise SpecExpertConfigError(
            FIELD, f"{busy}, which is writing it", "wait for it to finish, then start again"
        ) from None
    except NotALockFile as error:
        raise SpecExpertConfigError(
            FIELD, str(error), "remove it: the lock file is made again"
        ) from None
    try:
        return Disk(ExpertPack(path, model=model), queue_depth, direct, lock, mapped)
    except BaseException:
        lock.release()
        raise


SLOW_TIER = Disk
