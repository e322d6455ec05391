"""Whole-record reads from one file at a queue depth: the disk tier's I/O.

A record (one expert) is read in one piece into a page-aligned buffer by a pool of
threads (``os.preadv`` releases the GIL). ``O_DIRECT`` where the filesystem takes it:
a read costs what the disk costs and the engine's caches, not the page cache, decide
what stays in memory. It needs aligned offsets, lengths and buffers (:data:`ALIGN`,
anonymous mappings); elsewhere (tmpfs, some network filesystems) reads go through the
page cache and :attr:`DiskFile.direct` says so.
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

ALIGN = 4096
"""Alignment of record offsets, lengths and read buffers: the largest common logical block
size (4Kn), so a pack is readable with ``O_DIRECT`` anywhere."""


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed ``uint8`` tensor of ``aligned(nbytes)`` bytes, page-aligned (anonymous mapping)."""
    region = mmap.mmap(-1, max(aligned(nbytes), ALIGN))
    return torch.frombuffer(region, dtype=torch.uint8)


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

    def read_into(self, buffer: torch.Tensor, offset: int, length: int) -> None:
        """Read ``length`` bytes at aligned ``offset`` into a large enough
        :func:`aligned_buffer`; ``EOFError`` if the file ends before the record does."""
        view = buffer.numpy().data
        want = aligned(length) if self.direct else length
        done = 0
        while done < length:
            got = os.preadv(self.fd, [view[done:want]], offset + done)
            if got == 0:
                raise EOFError(
                    f"{self.path}: ends at byte {offset + done}, inside a record that "
                    f"ends at {offset + length}"
                )
            done += got

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class ReadStats:
    reads: int = 0
    bytes: int = 0
    busy_s: float = 0.0
    """Wall time with at least one read in flight (``bytes / busy_s``: the disk's throughput)."""
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
        with self._lock:
            self.reads, self.bytes, self.busy_s = 0, 0, 0.0
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
