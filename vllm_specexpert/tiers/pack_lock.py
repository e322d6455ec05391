"""The lock of an expert pack's directory: engines that read the pack hold it shared,
a writer (``specexpert pack``, or the start that makes a missing pack) holds it alone.

An advisory ``flock`` on the directory's ``.lock`` file: the kernel drops it when its
holder exits, however it exits, so a killed writer never leaves the pack locked. Who
holds it is read from ``/proc/locks`` (the lock file's inode), so that a refusal names
the process.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".lock"


class PackBusy(OSError):
    """The pack's lock is held in a way that excludes the one asked for."""

    def __init__(self, path: Path, holders: list[str]) -> None:
        self.holders = holders
        who = ", ".join(holders) if holders else "another process"
        super().__init__(f"{path} is in use by {who}")


class NotALockFile(OSError):
    """The pack's ``.lock`` is there but is no regular file (a directory, a device...)."""


class PackLock:
    """The lock of the pack directory ``path`` (the directory must exist)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd = -1

    def _open(self) -> int | None:
        """The lock file, made if absent; ``None`` where it cannot be made (a read-only
        filesystem: no writer can change the pack there, so readers need no lock)."""
        file = self.path / LOCK_FILE
        try:
            mode = file.lstat().st_mode
        except FileNotFoundError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise NotALockFile(f"{file}, the pack's lock, is not a regular file")
        try:
            return os.open(file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            if error.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
        try:
            return os.open(file, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None

    def acquire(self, exclusive: bool, wait: bool) -> None:
        """Take the lock (shared or exclusive); without ``wait``, :class:`PackBusy`
        naming the holders if it is taken."""
        if self._fd >= 0:
            raise RuntimeError(f"{self.path}: lock already held by this object")
        fd = self._open()
        if fd is None:
            return
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, mode | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holders = lock_holders(fd)
            os.close(fd)
            raise PackBusy(self.path, holders) from None
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # (closing the only descriptor drops the flock)
            self._fd = -1

    @property
    def held(self) -> bool:
        return self._fd >= 0

    @contextmanager
    def hold(self, exclusive: bool, wait: bool) -> Iterator[PackLock]:
        self.acquire(exclusive, wait)
        try:
            yield self
        finally:
            self.release()


def lock_holders(fd: int, proc: str | Path = "/proc") -> list[str]:
    """The processes that hold a ``flock`` on the file open at ``fd``, from
    ``/proc/locks`` (``<id>: FLOCK ADVISORY READ|WRITE <pid> <major>:<minor>:<inode> ...``)."""
    stat = os.fstat(fd)
    inode = f":{stat.st_ino}"
    pids: list[int] = []
    try:
        lines = Path(proc, "locks").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if "->" in fields:  # a waiter, not a holder
            continue
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].endswith(inode):
            pid = int(fields[4])
            if pid not in pids:
                pids.append(pid)
    return [f"pid {pid} ({_command(proc, pid)})" for pid in pids]


def _command(proc: str | Path, pid: int) -> str:
    try:
        raw = Path(proc, str(pid), "cmdline").read_bytes()
    except OSError:
        return "exited"
    words = raw.rstrip(b"\0").split(b"\0")
    text = " ".join(w.decode(errors="replace") for w in words)
    return text if len(text) <= 120 else text[:117] + "..."
