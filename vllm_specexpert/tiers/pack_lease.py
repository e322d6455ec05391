"""A read lease on the expert pack's records file (Linux ``F_SETLEASE``, ``F_RDLCK``),
held by the mapped residency (:mod:`.mapped`) so that no page its kernel reads can change
unseen (docs/design.md, "The disk tier": Trust).

While the lease is held, a process that opens the file for writing, or truncates it,
waits in the kernel until the holder lets go of the lease (or for
``/proc/sys/fs/lease-break-time``, 45 s by default), and the holder can tell. Whatever
writes to the file must open it for writing first (``write``, ``pwrite``, a writable
shared mapping): a write that was not seen coming cannot happen. The holder asks the
lease's state before each launch and after it (:meth:`PackLease.state`) and lets go only
there, so the writer proceeds only once the holder knows.

No signal is used: the kernel would send ``SIGIO`` at a break, whose default ends the
process. The lease's signal is set to ``SIGURG`` (ignored by default) before it is taken,
and its owner cleared after.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import signal
from enum import Enum


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
    """A read lease on the open file ``fd`` (opened read-only), taken at once."""

    def __init__(self, fd: int, path: object) -> None:
        self.fd = fd
        self.path = path
        self.held = False
        try:
            self._take()
        except OSError as error:
            raise LeaseRefused(error.errno, _why(error, path)) from None

    def state(self) -> LeaseState:
        """The lease now (module doc): a broken one is let go of, which lets its writer
        proceed, and taken again where no writer holds the file."""
        if self.held and fcntl.fcntl(self.fd, fcntl.F_GETLEASE) == fcntl.F_RDLCK:
            return LeaseState.HELD
        self.release()  # (broken: a break pending, or revoked after the break time)
        try:
            self._take()
        except OSError as error:
            if error.errno != errno.EAGAIN:
                raise
            return LeaseState.WRITING
        return LeaseState.RENEWED

    def release(self) -> None:
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


__all__ = ["LeaseRefused", "LeaseState", "PackLease"]
