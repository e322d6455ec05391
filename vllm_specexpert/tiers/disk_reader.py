"""Whole-tensor reads from one file at a queue depth: the disk tier's I/O.

An expert's tensor is read in one piece, where it is to be used (a slot), by a pool of
threads (``os.preadv`` releases the GIL). ``O_DIRECT`` where the filesystem takes it:
a read costs what the disk costs and the engine's caches, not the page cache, decide
what stays in memory. It needs aligned offsets, lengths and memory (:data:`ALIGN`;
:func:`aligned_empty` makes such memory); a read that is not aligned goes through a
bounce buffer. Elsewhere (tmpfs, some network filesystems) reads go through the page
cache and :attr:`DiskFile.direct` says so.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from vllm_specexpert.stats import Counters, counter, seconds

ALIGN = 4096
"""Alignment of record offsets, lengths and read buffers: the largest common logical block
size (4Kn), so a pack is readable with ``O_DIRECT`` anywhere."""


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed ``uint8`` tensor of ``aligned(nbytes)`` bytes, page-aligned (anonymous mapping)."""
    region = mmap.mmap(-1, max(aligned(nbytes), ALIGN))
    return torch.frombuffer(region, dtype=torch.uint8)


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor whose memory is page-aligned (as :func:`aligned_buffer`), so that
    ``O_DIRECT`` reads land in it."""
    count = 1
    for n in shape:
        count *= n
    return aligned_buffer(count * dtype.itemsize)[: count * dtype.itemsize].view(dtype).view(shape)


class DiskFile:
    """One file opened for aligned whole-record reads (``O_DIRECT`` where possible)."""

    def __init__(self, path: str | os.PathLike, direct: bool = True) -> None:
        self.path = os.fspath(path)
        self.direct = False
        """Whether reads bypass the page cache (``O_DIRECT`` asked for and taken)."""
        self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size
        if direct and hasattr(os, "O_DIRECT"):
            self._try_direct()

    def _try_direct(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            return
        probe = aligned_buffer(ALIGN)
        try:  # some filesystems accept the flag at open and refuse the read
            if self.size:
                os.preadv(fd, [probe.numpy().data], 0)
        except OSError as error:
            os.close(fd)
            if error.errno != errno.EINVAL:
                raise
            return
        os.close(self.fd)
        self.fd, self.direct = fd, True

    def bounces(self, offset: int, length: int, address: int = 0) -> bool:
        """Whether a read of ``length`` bytes at ``offset`` into memory at ``address`` goes
        through a bounce buffer (``O_DIRECT`` and something unaligned)."""
        return self.direct and bool((offset | length | address) % ALIGN)

    @staticmethod
    def bounce_nbytes(length: int) -> int:
        """The bounce buffer of an unaligned read of ``length`` bytes (whole blocks
        around it)."""
        return aligned(length) + ALIGN

    def read_into(self, buffer: torch.Tensor, offset: int, length: int) -> None:
        """Read ``length`` bytes at ``offset`` into the ``uint8`` tensor ``buffer`` (at
        least that long); ``EOFError`` if the file ends before they do."""
        if self.bounces(offset, length, buffer.data_ptr()):
            start = offset - offset % ALIGN
            bounce = aligned_buffer(self.bounce_nbytes(length))
            self._read(bounce, start, aligned(offset + length) - start, offset + length)
            # (through numpy: ``buffer`` may be a view made under vLLM's inference mode,
            # which torch would not let this thread write in place)
            view = buffer[:length].numpy()
            view[:] = bounce[offset - start : offset - start + length].numpy()
            return
        self._read(buffer, offset, length, offset + length)

    def _read(self, buffer: torch.Tensor, offset: int, length: int, ends: int) -> None:
        """``length`` bytes at ``offset`` into ``buffer``; the data ends at ``ends`` (the
        file may end after it, within the last aligned block)."""
        view = buffer.numpy().data
        done = 0
        while offset + done < ends:
            got = os.preadv(self.fd, [view[done:length]], offset + done)
            if got == 0:
                raise EOFError(
                    f"{self.path}: ends at byte {offset + done}, inside a tensor that "
                    f"ends at {ends}"
                )
            done += got

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class ReadStats(Counters):
    """The reader's reads as the disk served them (one per tensor), and its busy time."""

    reads: int = counter("Reads that completed (one per tensor of an expert).")
    bytes: int = counter("Bytes those reads read.")
    busy_s: float = seconds(
        "Wall time with at least one read in flight (``bytes / busy_s``: the disk's throughput)."
    )
    _in_flight: int = 0
    _busy_since: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def started(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1

    def finished(self, nbytes: int) -> None:
        """A read ended, with ``nbytes`` read (0: it failed)."""
        with self._lock:
            self._in_flight -= 1
            self.reads += 1 if nbytes else 0
            self.bytes += nbytes
            if self._in_flight == 0:
                self.busy_s += time.perf_counter() - self._busy_since

    def reset(self) -> None:
        """The counters zeroed under the readers' lock; reads in flight count their busy
        time from now."""
        with self._lock:
            super().reset()
            self._busy_since = time.perf_counter()

    @property
    def throughput_gbps(self) -> float:
        return self.bytes / self.busy_s / 1e9 if self.busy_s else 0.0


class DiskReader:
    """Reads records of one :class:`DiskFile` at queue depth ``depth`` (a thread each)."""

    def __init__(self, file: DiskFile, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"queue depth must be at least 1, not {depth}")
        self.file = file
        self.depth = depth
        self.stats = ReadStats()
        self._pool = ThreadPoolExecutor(depth, thread_name_prefix="specexpert-disk")

    def submit(
        self,
        buffer: torch.Tensor,
        offset: int,
        length: int,
        then: Callable[[], None] | None = None,
    ) -> Future[None]:
        """Queue a read, then ``then()`` on the same thread (so work on a record overlaps
        the other reads); the future raises what the read or ``then`` raised."""
        return self._pool.submit(self._read, buffer, offset, length, then)

    def _read(
        self,
        buffer: torch.Tensor,
        offset: int,
        length: int,
        then: Callable[[], None] | None,
    ) -> None:
        self.stats.started()
        done = 0
        try:
            self.file.read_into(buffer, offset, length)
            done = length
        finally:
            self.stats.finished(done)
        if then is not None:
            then()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.file.close()
