"""The mapped residency of the disk tier (``disk.residency: "mapped"``): the expert pack's
file mapped read-only, and the kernel run on the mapped pages of its kernel-form regions
(:mod:`.expert_pack`). The page cache is the cache, with no second copy in slots: it
holds what the memory the process leaves free holds, and the kernel decides what stays
(docs/design.md, "The disk tier").

Before a launch reads an expert, its pages are made readable (:meth:`MappedPack.populate`):
``MADV_WILLNEED`` on every missing range at once (the disk's read-ahead, at its depth),
then ``MADV_POPULATE_READ`` on each, which waits for the pages and maps them. A page that
cannot be read (an I/O error, a file truncated under the engine) is then an error of that
call, :class:`~.store.ExpertsUnreadable`, failing only the requests that needed it, never
a ``SIGBUS`` in the kernel. (A page reclaimed between the populate and the kernel's read
is read again by the fault; a file truncated in that window still raises ``SIGBUS``.)

An expert is checked against its checksums before a launch first runs on it, and again
whenever its pages had to be read in; one that fails is an error of the call like an
unreadable page, and is checked again when next needed. No write reaches the pages
unseen: the engine holds a read lease on the file (:mod:`.pack_lease`), asked before and
after each launch. A process that opens the file for writing waits until every engine
that holds a lease lets go, which its watcher thread does within a tenth of a second,
busy or idle; from then on, while any process holds the file open for writing, every
call on the mapped pack fails (its requests end with an error), and once none does,
every expert is checked again before its next use. A file that cannot be
leased (open for writing at the start, another user's, a filesystem without leases) is
not mapped: the slots are used, and the start line says why (docs/design.md, "The disk
tier": Trust).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from vllm_specexpert.stats import Counters, counter, seconds
from vllm_specexpert.tiers.expert_pack import (
    RECORDS_FILE,
    CorruptRecord,
    ExpertPack,
    PackLayer,
    PackTensor,
)
from vllm_specexpert.tiers.kernel_form import DTYPES
from vllm_specexpert.tiers.pack_experts import PackExperts
from vllm_specexpert.tiers.pack_lease import LeaseRefused, LeaseState, PackLease
from vllm_specexpert.tiers.slots import LayerSlotPool, PooledCache

PAGE = mmap.PAGESIZE
MADV_WILLNEED = 3
MADV_DONTNEED = 4
MADV_POPULATE_READ = 22
"""Linux 5.14+: fault the range in, waiting for its reads; an error instead of ``SIGBUS``."""
SAMPLED_PAGES = 16
"""Pages of a long expert range checked to find it present (:meth:`MappedPack.populate`)."""
WHOLE_RANGE_PAGES = 512
"""A range of at most this many pages is checked whole, in one ``mincore``: a call costs
about as much as 100 pages' lookups, so up to here one exact call is cheaper than
:data:`SAMPLED_PAGES` calls."""

_libc = ctypes.CDLL(None, use_errno=True)  # (its calls release the GIL)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


class MappingRefused(OSError):
    """The filesystem or kernel does not map the pack or populate its pages."""


@dataclass
class MappedStats(Counters):
    """What launches and prefetches on the mapped pack asked of the page cache."""

    populated: int = counter(
        "Expert tensors that had pages outside the page cache when a launch needed them."
    )
    bytes: int = counter("Bytes of those pages (what the disk was asked for).")
    wait_s: float = seconds("Seconds launches waited for pages.")
    failed: int = counter(
        "Experts a launch needed whose pages could not be read or did not match their checksums."
    )
    checked: int = counter(
        "Experts that matched their checksums when checked (at first use, when their pages "
        "were read in, after the file was opened for writing)."
    )
    writes_seen: int = counter(
        "Times another process opened the pack for writing (or truncated it) while the "
        "engine held its lease: calls failed while it held the file, and every expert was "
        "checked again after."
    )
    check_s: float = seconds("Seconds those checks took (in the launches' waits, ``wait_s``).")
    read_ahead: int = counter("Experts whose pages a prefetch asked the kernel to read ahead.")
    read_ahead_bytes: int = counter("Bytes of those pages.")


class MappedPack:
    """``experts.bin`` mapped read-only (shared with the page cache), its pages advised."""

    def __init__(self, pack: ExpertPack) -> None:
        self.pack = pack
        self.path = path = pack.path / RECORDS_FILE
        size = pack.manifest.records_bytes
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        """Kept open: its size, checked at each populate, shows a truncation."""
        try:
            region = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError as error:
            os.close(self.fd)
            raise MappingRefused(f"cannot map {path}: {error.strerror}") from None
        try:
            self.lease = PackLease(self.fd, path)
        except LeaseRefused as refused:
            os.close(self.fd)
            raise MappingRefused(str(refused)) from None
        with warnings.catch_warnings():  # (read-only: nothing writes to expert weights)
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.frombuffer(region, dtype=torch.uint8)
        self.address = self.bytes.data_ptr()
        self.stats = MappedStats()
        self._breaks_counted = 0
        """The lease's breaks counted in ``stats.writes_seen`` so far."""
        self._lock = threading.Lock()
        self._verified = {
            layer.name: np.zeros(layer.num_experts, dtype=bool) for layer in pack.manifest.layers
        }
        """Per layer, the experts whose pages matched their checksums and have not been
        read in since (cleared for all when the file was opened for writing)."""
        self._vector = np.empty(WHOLE_RANGE_PAGES, dtype=np.uint8)
        self._vector_address = self._vector.ctypes.data
        """``mincore``'s output, kept (making a ctypes address costs more than the call)."""
        try:
            self._advise(0, min(size, PAGE), MADV_POPULATE_READ)
        except OSError as error:
            self.close()
            raise MappingRefused(
                f"the kernel does not populate mapped pages ({error.strerror})"
            ) from None

    def views(self, layer: PackLayer) -> dict[str, torch.Tensor]:
        """The layer's tensors, ``[num_experts, ...]`` each, on the mapped pages."""
        out = {}
        for tensor in layer.tensors:
            region = self.bytes[tensor.offset : tensor.offset + layer.num_experts * tensor.nbytes]
            out[tensor.name] = region.view(DTYPES[tensor.dtype]).view(
                layer.num_experts, *tensor.shape
            )
        return out

    def populate(self, layer: PackLayer, experts: np.ndarray) -> tuple[int, int]:
        """Make the pages of ``experts`` readable, reading what the page cache lacks:
        read-ahead for every missing range at once, then, expert by expert, a wait for
        its pages and a check against its checksums if it was not checked since its
        pages were read in (the check overlaps the disk's reads of the next experts).
        Returns how many experts had pages to read and their bytes; one
        :class:`ExpertsUnreadable` names every expert whose pages could not be read or
        did not match.

        A long range counts as present when :data:`SAMPLED_PAGES` pages spread over it
        are (a full ``mincore`` of a 60 MB expert costs 0.4 ms, about as much as the
        kernel's work on it at batch 1); a page reclaimed between the samples is read
        by the kernel's fault, unchecked. A short one is checked whole (:meth:`_present`).
        A file shorter than the pack (truncated under the engine) populates every range,
        so that what is gone fails here, not in the kernel."""
        self._check_lease(layer, experts)
        whole = os.fstat(self.fd).st_size >= self.pack.manifest.records_bytes
        verified = self._verified[layer.name]
        missing: list[tuple[int, int, int]] = []  # (expert, offset, length)
        unchecked: list[int] = []
        for expert in experts.tolist():
            read_in = False
            for tensor in layer.tensors:
                offset, length = self._pages(tensor, expert)
                if not whole or not self._present(offset, length):
                    missing.append((expert, offset, length))
                    read_in = True
            if read_in or not verified[expert]:
                unchecked.append(expert)
        if not unchecked:
            return 0, 0
        started = time.perf_counter()
        nbytes = sum(self._missing_bytes(offset, length) for _, offset, length in missing)
        for _, offset, length in missing:
            # (a hint: the populate below reads, and reports, what it cannot)
            with contextlib.suppress(OSError):
                self._advise(offset, length, MADV_WILLNEED)
        ranges: dict[int, list[tuple[int, int]]] = {}
        for expert, offset, length in missing:
            ranges.setdefault(expert, []).append((offset, length))
        failed: dict[int, OSError] = {}
        check_s = 0.0
        for expert in unchecked:  # (each check overlaps the disk's reads of the next)
            try:
                for offset, length in ranges.get(expert, ()):
                    self._advise(offset, length, MADV_POPULATE_READ)
            except OSError as error:
                failed[expert] = error
                continue
            checking = time.perf_counter()
            try:
                self._check(layer, expert)
            except CorruptRecord as corrupt:
                failed[expert] = corrupt
            check_s += time.perf_counter() - checking
        finished = time.perf_counter()
        checked = [e for e in unchecked if e not in failed]
        with self._lock:
            verified[checked] = True
            verified[list(failed)] = False
            self.stats.populated += len(missing)
            self.stats.bytes += nbytes
            self.stats.wait_s += finished - started
            self.stats.checked += len(checked)
            self.stats.check_s += check_s
            self.stats.failed += len(failed)
        if failed:
            raise self.pack.unreadable(
                layer.name, {e: self._cause(error, whole) for e, error in failed.items()}
            ) from next(iter(failed.values()))
        return len({expert for expert, _, _ in missing}), nbytes

    def confirm(self, layer: PackLayer, experts: np.ndarray) -> None:
        """After a launch read the pages of ``experts``: fail it (one
        :class:`ExpertsUnreadable`) if the file was opened for writing while it ran."""
        self._check_lease(layer, experts, launched=True)

    def _check_lease(self, layer: PackLayer, experts: np.ndarray, launched: bool = False) -> None:
        """Raise :class:`ExpertsUnreadable` for every one of ``experts`` unless the lease
        was held since it was last asked, or (before a launch, not ``launched``) a
        writer came and went since: every check is forgotten then, and made again."""
        with self._lock:
            lease = self.lease.state()
            if lease is LeaseState.HELD:
                return
            for done in self._verified.values():
                done[:] = False
            # (the watcher may have let go first: the lease counts the breaks)
            self.stats.writes_seen += self.lease.breaks - self._breaks_counted
            self._breaks_counted = self.lease.breaks
            if lease is LeaseState.RENEWED and not launched:
                return
            self.stats.failed += len(experts)
        cause = (
            f"{self.path} is open for writing by another process: the mapped pack serves "
            "nothing until it is closed, then checks every expert again"
            if lease is LeaseState.WRITING
            else f"{self.path} was written to while a launch read it"
        )
        raise self.pack.unreadable(layer.name, dict.fromkeys(np.unique(experts).tolist(), cause))

    def _cause(self, error: OSError, whole: bool) -> str:
        """Why an expert's pages failed, as logged."""
        if isinstance(error, CorruptRecord):
            cause = str(error)
        elif error.errno == errno.EFAULT and not whole:
            cause = f"{self.path}: the file ends before them (truncated?)"
        elif error.errno == errno.EFAULT:
            cause = f"{self.path}: their pages could not be read (an I/O error)"
        else:
            cause = f"{self.path}: {error.strerror}"
        return f"{type(error).__name__}: {cause}"

    def _check(self, layer: PackLayer, expert: int) -> None:
        """``expert``'s tensors, on the mapped pages, against their checksums; on a
        mismatch its pages are dropped from the page cache (where no one else maps
        them), so that the next check reads the disk again."""
        for tensor in layer.tensors:
            start = tensor.at(expert)
            try:
                self.pack.check_read(
                    layer, tensor, expert, self.bytes[start : start + tensor.nbytes].numpy().data
                )
            except CorruptRecord:
                for other in layer.tensors:
                    offset, length = self._pages(other, expert)
                    with contextlib.suppress(OSError):
                        self._advise(offset, length, MADV_DONTNEED)
                        os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_DONTNEED)
                raise

    def read_ahead(self, layer: PackLayer, experts: np.ndarray) -> tuple[int, int]:
        """Start reading the pages of ``experts`` that the page cache lacks
        (``MADV_WILLNEED``), without waiting: a prefetch. Returns how many experts had
        pages to read and their bytes. A hint: a range the kernel does not read ahead is
        read by :meth:`populate` when a launch needs it. (Pages being read count as
        present to :meth:`populate`; a read that then fails is a ``SIGBUS`` at the
        kernel's fault, a risk only a prefetch's own read error takes.)"""
        asked: set[int] = set()
        nbytes = 0
        for expert in experts.tolist():
            for tensor in layer.tensors:
                offset, length = self._pages(tensor, expert)
                if self._present(offset, length):
                    continue
                missing = self._missing_bytes(offset, length)
                with self._lock:  # (pages read in: checked again at the launch)
                    self._verified[layer.name][expert] = False
                with contextlib.suppress(OSError):
                    self._advise(offset, length, MADV_WILLNEED)
                    asked.add(expert)
                    nbytes += missing
        with self._lock:
            self.stats.read_ahead += len(asked)
            self.stats.read_ahead_bytes += nbytes
        return len(asked), nbytes

    def unreadable(self, layer: PackLayer, experts: np.ndarray) -> np.ndarray:
        """``bool [len(experts)]``: which of ``experts`` have pages the page cache lacks
        (:meth:`_present`'s test, over each tensor)."""
        return np.array(
            [
                not all(self._present(*self._pages(tensor, expert)) for tensor in layer.tensors)
                for expert in experts.tolist()
            ],
            dtype=bool,
        )

    def reset_stats(self) -> None:
        with self._lock:
            self.stats.reset()

    def close(self) -> None:
        """Let go of the lease and close the file (the mapping goes with the last view
        of it)."""
        if self.fd >= 0:
            self.lease.close()
            os.close(self.fd)
            self.fd = -1

    @staticmethod
    def _pages(tensor: PackTensor, expert: int) -> tuple[int, int]:
        """The whole pages holding ``expert``'s copy of ``tensor``: ``(offset, length)``."""
        start = tensor.at(expert)
        first = start - start % PAGE
        end = -(-(start + tensor.nbytes) // PAGE) * PAGE
        return first, end - first

    def _present(self, offset: int, length: int) -> bool:
        """Whether the range's pages are in the page cache: all of them, in one call, up
        to :data:`WHOLE_RANGE_PAGES`; else :data:`SAMPLED_PAGES` spread over it."""
        pages = length // PAGE
        vector = self._vector
        if pages <= WHOLE_RANGE_PAGES:
            if _libc.mincore(self.address + offset, length, self._vector_address):
                return False
            return bool(vector[:pages].all())  # (mincore's other bits are 0)
        step = pages // SAMPLED_PAGES
        address = self.address + offset
        for page in range(0, pages, step):
            if _libc.mincore(address + page * PAGE, PAGE, self._vector_address):
                return False
            if not vector[0] & 1:
                return False
        return True

    def _missing_bytes(self, offset: int, length: int) -> int:
        """Bytes of the range's pages that are not in the page cache."""
        vector = np.empty(length // PAGE, dtype=np.uint8)
        if _libc.mincore(self.address + offset, length, vector.ctypes.data) != 0:
            return length
        return int(np.count_nonzero((vector & 1) == 0)) * PAGE

    def _advise(self, offset: int, length: int, advice: int) -> None:
        if _libc.madvise(self.address + offset, length, advice) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))


class MappedExperts(PackExperts):
    """One layer's experts on the mapped pack, as an
    :class:`~vllm_specexpert.tiers.store.ExpertSource` whose kernel pool is the mapping."""

    in_place = True

    def __init__(self, mapping: MappedPack, layer: PackLayer) -> None:
        super().__init__(mapping.pack, layer)
        self.mapping = mapping

    @property
    def staging_nbytes(self) -> int:
        return 0

    def kernel_pool(self, device: torch.device) -> MappedPool:
        return MappedPool(device, self)

    def gather(self, experts: np.ndarray) -> dict[str, torch.Tensor]:
        experts = np.asarray(experts)
        self.mapping.populate(self.record, experts)
        index = torch.from_numpy(experts.astype(np.int64))
        out = {k: t.index_select(0, index) for k, t in self.mapping.views(self.record).items()}
        self.mapping.confirm(self.record, experts)
        return out

    def copy_into(
        self,
        experts: np.ndarray,
        slots: np.ndarray,
        destinations: dict[str, torch.Tensor],
        device: torch.device | None = None,
    ) -> None:
        """Nothing to copy: every expert is where the kernel reads it (its pool's
        "slot" ``e`` is expert ``e``'s region); pages come when a launch needs them."""
        if not np.array_equal(experts, slots):
            raise ValueError(f"{self.name}: a mapped expert has no other slot than its own")

    def populate(self, experts: np.ndarray) -> tuple[int, int]:
        return self.mapping.populate(self.record, experts)

    def read_ahead(self, experts: np.ndarray) -> tuple[int, int]:
        return self.mapping.read_ahead(self.record, experts)

    def confirm(self, experts: np.ndarray) -> None:
        self.mapping.confirm(self.record, experts)

    def unreadable(self, experts: np.ndarray) -> np.ndarray:
        return self.mapping.unreadable(self.record, experts)


class MappedPool(LayerSlotPool):
    """One layer's "slots": its regions in the mapped pack, expert ``e`` in slot ``e``,
    no memory of their own. A launch first makes its experts' pages readable."""

    readable_as_is = False

    def __init__(self, device: torch.device, experts: MappedExperts) -> None:
        if device.type != "cpu":
            raise ValueError("a mapped pack is read by the CPU build's kernel only")
        super().__init__(device)
        self.experts = experts

    def allocate(self) -> None:
        total = self.joined_slots
        self.tensors = self.experts.mapping.views(self.experts.record)
        self.owner = np.full(total, -1, dtype=np.int32)
        self.in_flight.clear()
        cache: PooledCache
        for cache in self.caches:
            cache.warm_start(0, total)

    def readable(self, slots: torch.Tensor) -> tuple[int, int]:
        return self.experts.populate(np.unique(slots.numpy()))

    def confirm(self, slots: torch.Tensor) -> None:
        self.experts.confirm(slots.numpy())

    def read_ahead(self, slots: np.ndarray) -> tuple[int, int]:
        return self.experts.read_ahead(slots)

    def unreadable(self, slots: np.ndarray) -> np.ndarray:
        return self.experts.unreadable(slots)


__all__ = ["MappedExperts", "MappedPack", "MappedPool", "MappingRefused"]
