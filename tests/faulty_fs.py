"""A read-only FUSE filesystem over a directory whose reads fail (``EIO``) where a test
says: the "read error from the device" a disk tier must survive, from the kernel's side
of a real filesystem (page cache, ``O_DIRECT``, faults of a mapping), not a patched call.

Run as a process (:class:`FaultyMount` starts it)::

    python faulty_fs.py SOURCE MOUNTPOINT FAILURES

``FAILURES`` is a JSON file ``{"file name": [[start, end], ...]}``, read again whenever it
changes: a read of that file overlapping a range fails. Needs libfuse 3 (Debian's
``fuse3``) and ``mfusepy``; :func:`mount_or_reason` says why where there is none."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def serve(source: str, mountpoint: str, failures: str) -> None:
    import mfusepy as fuse

    class Faulty(fuse.Operations):
        use_ns = True

        def __init__(self) -> None:
            self.ranges: dict[str, list[tuple[int, int]]] = {}
            self.seen = -1

        def _path(self, path: str) -> str:
            return os.path.join(source, path.lstrip("/"))

        def _failing(self, path: str, offset: int, size: int) -> bool:
            try:
                changed = os.stat(failures).st_mtime_ns
            except FileNotFoundError:
                changed = 0
            if changed != self.seen:
                self.seen = changed
                text = Path(failures).read_text() if changed else "{}"
                self.ranges = {k: [tuple(r) for r in v] for k, v in json.loads(text).items()}
            ranges = self.ranges.get(os.path.basename(path), [])
            return any(start < offset + size and offset < end for start, end in ranges)

        def getattr(self, path: str, fh: int | None = None) -> dict:
            st = os.lstat(self._path(path))
            keys = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid")
            times = ("st_atime_ns", "st_mtime_ns", "st_ctime_ns")
            return {
                **{k: getattr(st, k) for k in keys},
                **{k.removesuffix("_ns"): getattr(st, k) for k in times},
            }

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(self._path(path))]

        def open(self, path: str, flags: int) -> int:
            return os.open(self._path(path), os.O_RDONLY)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            if self._failing(path, offset, size):
                raise fuse.FuseOSError(errno.EIO)
            return os.pread(fh, size, offset)

        def release(self, path: str, fh: int) -> int:
            os.close(fh)
            return 0

    fuse.FUSE(Faulty(), mountpoint, foreground=True, ro=True, nothreads=True)


class FaultyMount:
    """``source`` mounted read-only at ``mountpoint`` through :func:`serve`."""

    def __init__(self, source: Path, mountpoint: Path) -> None:
        self.source, self.mountpoint = source, mountpoint
        self.failures = mountpoint.parent / f"{mountpoint.name}.failures.json"
        mountpoint.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(source), str(mountpoint), str(self.failures)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 30
        while not os.path.ismount(mountpoint):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise OSError(f"the FUSE mount did not come up: {self.error()}")
            time.sleep(0.05)

    def fail(self, name: str, ranges: list[tuple[int, int]]) -> None:
        """Reads of ``name`` overlapping ``ranges`` fail from now on (``[]``: none), and
        its pages leave the page cache, so that the next read asks the filesystem."""
        staged = self.failures.with_suffix(".partial")
        staged.write_text(json.dumps({name: ranges}))
        os.replace(staged, self.failures)
        fd = os.open(self.mountpoint / name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def error(self) -> str:
        if self.process.poll() is None:
            return "still starting"
        return (self.process.stderr.read() if self.process.stderr else "").strip()[-300:]

    def close(self) -> None:
        if os.path.ismount(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False)
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def mount_or_reason(source: Path, mountpoint: Path) -> FaultyMount | str:
    """A :class:`FaultyMount`, or why none can be made here."""
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as error:  # (mfusepy raises OSError without libfuse)
        return f"no FUSE: mfusepy cannot load libfuse ({error}); install Debian's fuse3"
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        return "no FUSE: /dev/fuse or fusermount3 is missing (install Debian's fuse3)"
    try:
        return FaultyMount(source, mountpoint)
    except OSError as error:
        return str(error)


if __name__ == "__main__":
    serve(*sys.argv[1:4])
