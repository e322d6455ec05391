"""A read lease on the expert pack's records file (Linux ``F_SETLEASE``, ``F_RDLCK``),
held by the mapped residency (:mod:`.mapped`) so that no page its kernel reads can change
unseen (docs/design.md, "The disk tier": Trust).

While the lease is held, a process that opens the file for writing, or truncates it,
waits in the kernel until every holder of a lease on the file lets go (or for
``/proc/sys/fs/lease-break-time``, 45 s by default), and the holder can tell. Whatever
writes to the file must open it for writing first (``write``, ``pwrite``, a writable
shared mapping): a write that was not seen coming cannot happen.

A holder lets go as soon as it sees the break, busy or idle: a watcher thread asks the
lease's state every :data:`WATCH_INTERVAL_S` and lets go of a broken lease at once, so
that a writer waits about that long, not the break time, however many engines hold the
file. The lease is taken again only when the engine next asks (:meth:`PackLease.state`,
before each launch and after it): a launch that ran while the lease was let go is then
known to have run unprotected.

A lease sees the writers that open the file through this machine's kernel, so it is
taken only on a filesystem that every write passes through here (:data:`LOCAL_FILESYSTEMS`:
ext4, xfs, btrfs, tmpfs, ...). On FUSE, NFS, SMB, 9p, Ceph or overlayfs the kernel grants
the lease, but a write from elsewhere (the FUSE daemon's own files, another machine, the
directories under an overlay) breaks none: the lease is refused there (found on the
project's FUSE test filesystem: granted, and not broken by a write to its source).

No signal is used: the kernel would send ``SIGIO`` at a break, whose default ends the
process. The lease's signal is set to ``SIGURG`` (ignored by default) before it is taken,
and its owner cleared after.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import signal
import threading
from enum import Enum

WATCH_INTERVAL_S = 0.1
"""How often the watcher asks whether a writer waits (one ``fcntl`` each): the longest a
writer's open waits for this holder."""


LOCAL_FILESYSTEMS = {
    0xEF53: "ext2/3/4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0xF2F52010: "f2fs",
    0xCA451A4E: "bcachefs",
    0x2FC12FC1: "zfs",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
}
"""``statfs`` magic -> name of the filesystems every write to whose files passes through
this kernel (``linux/magic.h``): a lease there sees every writer."""
OTHER_FILESYSTEMS = {
    0x65735546: "fuse",
    0x6969: "nfs",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x01021997: "9p",
    0x00C36400: "ceph",
    0x794C7630: "overlay",
}
"""Names for the refusal of the filesystems a write reaches from elsewhere."""

_libc = ctypes.CDLL(None, use_errno=True)


def filesystem_of(fd: int) -> tuple[int, str]:
    """The ``statfs`` magic of the filesystem holding ``fd``, and its name."""
    buffer = ctypes.create_string_buffer(256)  # (struct statfs: f_type first, a long)
    if _libc.fstatfs(fd, buffer) != 0:
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number))
    magic = int.from_bytes(buffer.raw[:8], "little") & 0xFFFFFFFF
    name = LOCAL_FILESYSTEMS.get(magic) or OTHER_FILESYSTEMS.get(magic) or f"{magic:#x}"
    return magic, name


class LeaseRefused(OSError):
    """The file cannot be leased: open for writing now, not this user's, or on a
    filesystem without leases."""


class LeaseState(Enum):
    HELD = "held"
    """Held since the last ask: nothing opened the file for writing."""
    RENEWED = "renewed"
    """A writer opened the file since the last ask and has closed it: held again, and
    any byte of the file may differ."""
    WRITING = "writing"
    """A process holds the file open for writing (or mapped writable) now: not held."""


class PackLease:
    """A read lease on the open file ``fd`` (opened read-only), taken at once, and its
    watcher (module doc); :meth:`close` lets go of both."""

    def __init__(self, fd: int, path: object, interval_s: float = WATCH_INTERVAL_S) -> None:
        self.fd = fd
        self.path = path
        self.held = False
        self.breaks = 0
        """Times a held lease was found broken (a writer came), by the watcher or an ask."""
        self._lock = threading.Lock()
        magic, name = filesystem_of(fd)
        if magic not in LOCAL_FILESYSTEMS:
            raise LeaseRefused(
                errno.EOPNOTSUPP,
                f"{path} is on a {name} filesystem, where a write from elsewhere (another "
                "machine, the filesystem's own server or daemon, a directory beneath it) "
                "breaks no lease: a changed page would reach the kernel unchecked (the "
                f"lease sees every writer on {', '.join(LOCAL_FILESYSTEMS.values())})",
            )
        try:
            self._take()
        except OSError as error:
            raise LeaseRefused(error.errno, _why(error, path)) from None
        self._closed = threading.Event()
        self._watcher = threading.Thread(
            target=self._watch, args=(interval_s,), name="specexpert-lease", daemon=True
        )
        self._watcher.start()

    def state(self) -> LeaseState:
        """The lease now (module doc): a broken one is let go of, which lets its writer
        proceed, and taken again where no writer holds the file."""
        with self._lock:
            if self.held and self._intact():
                return LeaseState.HELD
            self._let_go()  # (broken: a break pending, or revoked after the break time)
            try:
                self._take()
            except OSError as error:
                if error.errno != errno.EAGAIN:
                    raise
                return LeaseState.WRITING
            return LeaseState.RENEWED

    def let_go_if_broken(self) -> bool:
        """Let go of the lease if a writer waits for it (the watcher's ask); it is not
        taken again here (:meth:`state` does, and says what happened meanwhile)."""
        with self._lock:
            if not self.held or self._intact():
                return False
            self._let_go()
            return True

    def release(self) -> None:
        with self._lock:
            self._unlock()

    def close(self) -> None:
        """Stop the watcher and let go of the lease (before the file is closed)."""
        self._closed.set()
        self._watcher.join()
        self.release()

    def _watch(self, interval_s: float) -> None:
        while not self._closed.wait(interval_s):
            with contextlib.suppress(OSError):  # (the file closed under it: stopping)
                self.let_go_if_broken()

    def _intact(self) -> bool:
        return fcntl.fcntl(self.fd, fcntl.F_GETLEASE) == fcntl.F_RDLCK

    def _let_go(self) -> None:
        """(Under the lock.) A held lease found broken: counted and let go of."""
        self.breaks += self.held
        self._unlock()

    def _unlock(self) -> None:
        if self.held:
            self.held = False
            with contextlib.suppress(OSError):  # (revoked already)
                fcntl.fcntl(self.fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)

    def _take(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(self.fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        fcntl.fcntl(self.fd, fcntl.F_SETOWN, 0)
        self.held = True


def _why(error: OSError, path: object) -> str:
    if error.errno == errno.EAGAIN:
        return (
            f"{path} is open for writing by another process: a page it wrote would reach "
            "the kernel unchecked"
        )
    if error.errno == errno.EACCES:
        return (
            f"{path} belongs to another user: the engine may not lease it (the file's "
            "owner or CAP_LEASE may), so writes to it could not be seen coming"
        )
    return f"{path} cannot be leased here ({error.strerror}): writes to it could not be seen"


__all__ = [
    "LOCAL_FILESYSTEMS",
    "WATCH_INTERVAL_S",
    "LeaseRefused",
    "LeaseState",
    "PackLease",
    "filesystem_of",
]
