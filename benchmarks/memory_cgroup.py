"""A memory-limited cgroup for a child process: made with a limit, the child moved in before
it runs, its peak usage, OOM kills and page cache read, removed after. Cgroup v1's memory
hierarchy or cgroup v2, whichever holds the memory controller here.

The cgroup is made under this process's own (not at the top of the tree), so that any
limit already over this process still binds its children. Swap is kept out of the limit:
a limited child that could swap would be measured on a slower machine, not a smaller one.

    python benchmarks/memory_cgroup.py --self-check

allocates 400 MB in a 200 MB cgroup (killed, peak near 200 MB) and 100 MB in another
(not killed): whether the limit binds and is read back on this machine (root only).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple


class _Files(NamedTuple):
    """One version's files: the limit, the usage and its peak, the file whose ``oom_kill``
    line counts the kills, memory.stat's page-cache keys (v1's ``total_`` ones include
    descendants), and the swap limit with the value that keeps swap out."""

    limit: str
    usage: str
    peak: str
    oom: str
    cache: tuple[str, ...]
    swap: str
    no_swap: str


_FILES = {
    # memsw is memory + swap: set to the limit, it leaves no swap.
    "v1": _Files(
        "memory.limit_in_bytes",
        "memory.usage_in_bytes",
        "memory.max_usage_in_bytes",
        "memory.oom_control",
        ("total_cache", "cache"),
        "memory.memsw.limit_in_bytes",
        "{limit}",
    ),
    # memory.peak: Linux 5.19 and later.
    "v2": _Files(
        "memory.max",
        "memory.current",
        "memory.peak",
        "memory.events",
        ("file",),
        "memory.swap.max",
        "0",
    ),
}


class CgroupError(RuntimeError):
    """A memory cgroup could not be made or used here; the message says why."""


@dataclass(frozen=True)
class MemoryCgroup:
    path: Path
    version: str
    """``"v1"`` or ``"v2"``."""

    @classmethod
    def create(cls, limit_bytes: int, name: str) -> MemoryCgroup:
        """A new cgroup ``name`` under this process's own, limited to ``limit_bytes``."""
        version, parent = _own_directory()
        if version == "v2":
            _delegate_memory(parent)
        path = parent / name
        try:
            path.mkdir()
        except OSError as error:
            raise CgroupError(
                f"cannot make the cgroup {path}: {error.strerror} (it needs root, or a "
                "cgroup delegated to this user)"
            ) from error
        cgroup = cls(path, version)
        files = _FILES[version]
        try:
            (path / files.limit).write_text(str(limit_bytes))
            if (path / files.swap).exists():
                (path / files.swap).write_text(files.no_swap.format(limit=limit_bytes))
        except OSError as error:
            with contextlib.suppress(OSError):
                path.rmdir()
            raise CgroupError(f"cannot limit {path}: {error}") from error
        return cgroup

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> MemoryCgroup:
        """An existing cgroup (one a parent made), to read from."""
        path = Path(path)
        return cls(path, "v2" if (path / "memory.max").exists() else "v1")

    def add(self, pid: int) -> None:
        """Moves process ``pid`` in: what it allocates from then on is charged here (from a
        ``preexec_fn``, see :meth:`enter`)."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def enter(self) -> None:
        """Moves the calling process in: as a ``preexec_fn``, the child is in before it
        runs anything."""
        self.add(os.getpid())

    def limit_bytes(self) -> int:
        return self._int(_FILES[self.version].limit)

    def usage_bytes(self) -> int:
        return self._int(_FILES[self.version].usage)

    def peak_bytes(self) -> int | None:
        """The most it was charged (its page cache included); ``None`` where the kernel
        keeps no peak (cgroup v2 before Linux 5.19)."""
        try:
            return self._int(_FILES[self.version].peak)
        except OSError:
            return None

    def oom_kills(self) -> int | None:
        """Processes the OOM killer killed in it; ``None`` where the kernel does not count
        them (v1 before Linux 4.13)."""
        return self._key(_FILES[self.version].oom, ("oom_kill",))

    def page_cache_bytes(self) -> int | None:
        """File pages charged to it now (page cache counts to a cgroup's usage)."""
        return self._key("memory.stat", _FILES[self.version].cache)

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def figures(self) -> dict:
        """Its limit, peak, OOM kills, usage and page cache now, for a result file."""
        gb = lambda n: None if n is None else n / 1e9
        return {
            "cgroup": str(self.path),
            "cgroup_version": self.version,
            "limit_gb": gb(self.limit_bytes()),
            "peak_gb": gb(self.peak_bytes()),
            "oom_kills": self.oom_kills(),
            "usage_gb_end": gb(self.usage_bytes()),
            "page_cache_gb_end": gb(self.page_cache_bytes()),
        }

    def remove(self, timeout_s: float = 10.0) -> None:
        """Removes it: waits up to ``timeout_s`` for what runs in it to exit, then kills
        what is left (the child's own children: nothing else is put here)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # (EBUSY: processes still in it)
                if time.monotonic() > deadline:
                    for pid in self.pids():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    if time.monotonic() > deadline + timeout_s:
                        raise
                time.sleep(0.1)

    def _int(self, name: str) -> int:
        text = (self.path / name).read_text().strip()
        return 1 << 63 if text == "max" else int(text)

    def _key(self, name: str, keys: tuple[str, ...]) -> int | None:
        """The first of ``keys`` in a ``key value`` file; ``None`` if none is there."""
        try:
            lines = (self.path / name).read_text().splitlines()
        except OSError:
            return None
        values = dict(line.split(None, 1) for line in lines if len(line.split()) == 2)
        for key in keys:
            if key in values:
                return int(values[key])
        return None


def _own_directory() -> tuple[str, Path]:
    """The version and directory of this process's cgroup in the hierarchy that holds the
    memory controller: v1's memory hierarchy first (a hybrid system mounts v2 beside it
    without the controller), else v2."""
    mounts: dict[str, tuple[str, str]] = {}  # version: (root in the tree, mount point)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, rest = line.partition(" - ")
        head, tail = fields.split(), rest.split()
        if len(head) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup" and "memory" in tail[2].split(","):
            mounts.setdefault("v1", (head[3], head[4]))
        elif tail[0] == "cgroup2":
            mounts.setdefault("v2", (head[3], head[4]))
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:
            own["v2"] = path
        elif "memory" in controllers.split(","):
            own["v1"] = path
    for version in ("v1", "v2"):
        if version in mounts and version in own:
            root, point = mounts[version]
            relative = os.path.relpath(own[version], root)
            # A cgroup outside the mount's root (another namespace's): the mount itself.
            outside = relative == ".." or relative.startswith("../")
            return version, Path(point) if outside else Path(point) / relative
    raise CgroupError("no memory controller is mounted (neither cgroup v1's nor cgroup v2)")


def _delegate_memory(parent: Path) -> None:
    """Cgroup v2 gives a child the memory controller only if its parent delegates it."""
    control = parent / "cgroup.subtree_control"
    if "memory" in control.read_text().split():
        return
    try:
        control.write_text("+memory")
    except OSError as error:
        raise CgroupError(
            f"cgroup v2's memory controller is not delegated by {parent} and could not be "
            f"({error.strerror}: a cgroup that holds processes cannot delegate it)"
        ) from error


# --- the self-check ----------------------------------------------------------------------

ALLOCATE = """
import sys
chunks = [bytearray(b"\\x01") * 10**7 for _ in range(int(sys.argv[1]) // 10)]
print(sum(map(len, chunks)) // 10**6, "MB allocated", flush=True)
"""
"""Allocates (and touches) ``argv[1]`` MB in 10 MB bytearrays."""


def self_check(limit_mb: int = 200) -> bool:
    """A child allocating twice ``limit_mb`` in a cgroup of ``limit_mb`` is killed, one
    OOM kill counted and the peak near the limit; a child allocating half of it is not."""
    ok = True
    for allocate_mb in (2 * limit_mb, limit_mb // 2):
        cgroup = MemoryCgroup.create(limit_mb * 10**6, f"memory-cgroup-check-{os.getpid()}")
        if allocate_mb == 2 * limit_mb:
            print(f"cgroup {cgroup.version} at {cgroup.path}, limit {limit_mb} MB")
        try:
            child = subprocess.run(
                [sys.executable, "-c", ALLOCATE, str(allocate_mb)],
                preexec_fn=cgroup.enter,
                capture_output=True,
                text=True,
                timeout=120,
            )
            peak, kills, limit = cgroup.peak_bytes(), cgroup.oom_kills(), cgroup.limit_bytes()
        finally:
            cgroup.remove()
        killed = child.returncode == -signal.SIGKILL
        if allocate_mb > limit_mb:
            expected = killed and kills == 1 and peak is not None and peak > 0.9 * limit
        else:
            fits = peak is not None and allocate_mb * 10**6 < peak < limit
            expected = child.returncode == 0 and kills == 0 and fits
        ok &= expected and not cgroup.path.exists()
        ended = "killed by SIGKILL" if killed else f"exit {child.returncode}"
        said = child.stdout.strip() or child.stderr.strip()[-200:]
        print(
            f"allocate {allocate_mb} MB: {ended} ({said or 'nothing printed'}), OOM kills "
            f"{kills}, peak {'unknown' if peak is None else f'{peak / 1e6:.1f} MB'}, cgroup "
            f"{'left behind' if cgroup.path.exists() else 'removed'}: "
            f"{'as expected' if expected else 'NOT as expected'}"
        )
    print("self-check passed" if ok else "self-check FAILED")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--self-check", action="store_true", help="(see above; root only)")
    args = parser.parse_args()
    if not args.self_check:
        parser.print_help()
        return
    try:
        ok = self_check()
    except CgroupError as error:
        sys.exit(f"self-check: no memory cgroup: {error}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
