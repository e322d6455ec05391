"""Free memory of the tier a budget sizes: the GPU's on CUDA; on CPU ``MemAvailable``
(free plus reclaimable page cache), or less if a cgroup limit leaves less; a cgroup's
limit is then the tier's total too. Swap is never counted as room (an expert in swap
would be read back at the disk's speed with none of the disk tier's reads), so a swap
limit changes nothing here."""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from vllm_specexpert.config.sizing import MemoryReport, SizingSettings

UNLIMITED = 1 << 60
"""A limit at or above this is none (cgroup v1 writes none as 9223372036854771712)."""


@dataclass(frozen=True)
class CgroupMemory:
    limit_bytes: int
    """The tightest limit of the process's cgroup and its ancestors' (v2: ``memory.max``
    or ``memory.high``, past which the kernel reclaims and throttles the cgroup)."""
    free_bytes: int
    """What the limits leave: over every limited level, the least of ``limit - charged``
    (``charged``: the level's usage less its inactive page cache)."""


# Per cgroup version: the limit's file, the usage's, and memory.stat's keys of the
# reclaimable page cache (v1's ``total_`` keys count the descendants, as its usage does).
_FILES = {
    "v2": (("memory.max", "memory.high"), "memory.current", ("inactive_file",)),
    "v1": (
        ("memory.limit_in_bytes",),
        "memory.usage_in_bytes",
        ("total_inactive_file", "inactive_file"),
    ),
}


def cgroup_memory(root: str | os.PathLike[str] = "/") -> CgroupMemory | None:
    """This process's cgroup memory limit and what it leaves (v2 and v1's memory
    hierarchy), read under ``root`` (tests give a fake tree). Every ancestor up to the
    mount is read: each limit binds. ``None`` where none is limited or readable."""
    root = Path(root)
    limit: int | None = None
    free: int | None = None
    for version, directory in _cgroup_dirs(root):
        limit_files, usage_file, reclaimable_keys = _FILES[version]
        limits = [_read_int(directory / name) for name in limit_files]
        level_limit = min((n for n in limits if n is not None), default=None)
        if level_limit is None or level_limit >= UNLIMITED:
            continue
        usage = _read_int(directory / usage_file) or 0
        # Inactive page cache is reclaimed before the OOM killer acts (kubelet's working set).
        reclaimable = _stat(directory / "memory.stat", reclaimable_keys)
        left = max(level_limit - max(usage - reclaimable, 0), 0)
        limit = level_limit if limit is None else min(limit, level_limit)
        free = left if free is None else min(free, left)
    if limit is None or free is None:
        return None
    return CgroupMemory(limit_bytes=limit, free_bytes=free)


def _cgroup_dirs(root: Path) -> list[tuple[str, Path]]:
    """This process's cgroup directories (v2, v1 memory) and ancestors up to the mounts."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    paths: dict[str, str] = {}
    for line in lines:
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            paths.setdefault("v2", path)
        elif "memory" in controllers.split(","):
            paths.setdefault("v1", path)
    mounts = _mounts(root)
    found = []
    for version, path in paths.items():
        if version not in mounts:
            continue
        mount_root, mount_point = mounts[version]
        top = root / mount_point.lstrip("/")
        relative = os.path.relpath(path, mount_root)
        # A cgroup outside the mount's root (another namespace's) leaves only the mount.
        directory = top if relative == ".." or relative.startswith("../") else top / relative
        while True:
            found.append((version, directory))
            if directory == top or top not in directory.parents:
                break
            directory = directory.parent
    return found


def _mounts(root: Path) -> dict[str, tuple[str, str]]:
    """Cgroup v2's and v1 memory's (root in the cgroup tree, mount point), from mountinfo."""
    try:
        lines = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return {"v2": ("/", "/sys/fs/cgroup"), "v1": ("/", "/sys/fs/cgroup/memory")}
    mounts: dict[str, tuple[str, str]] = {}
    for line in lines:
        # ID parent major:minor root mount-point options [optional...] - type source super-options
        fields, _, rest = line.partition(" - ")
        head, tail = fields.split(), rest.split()
        if len(head) < 5 or len(tail) < 3:
            continue
        place = (_unescape(head[3]), _unescape(head[4]))
        if tail[0] == "cgroup2":
            mounts.setdefault("v2", place)
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            mounts.setdefault("v1", place)
    return mounts


def _unescape(text: str) -> str:
    """mountinfo's octal escapes (``\\040`` for a space)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def _read_int(path: Path) -> int | None:
    """``max`` reads as :data:`UNLIMITED`; ``None`` if unreadable."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, keys: tuple[str, ...]) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    values = dict(line.split(None, 1) for line in lines if len(line.split()) == 2)
    for key in keys:
        if key in values:
            try:
                return int(values[key])
            except ValueError:
                return 0
    return 0


def memory_report(
    device: torch.device, settings: SizingSettings, freed_bytes: int = 0
) -> MemoryReport:
    """The memory of ``device``'s tier now, with vLLM's share and KV settings."""
    limit = None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    else:
        ram = psutil.virtual_memory()
        free, total = ram.available, ram.total
        cgroup = cgroup_memory()
        if cgroup is not None:  # (the machine a budget sizes from is the cgroup's)
            free, limit = min(free, cgroup.free_bytes), cgroup.limit_bytes
            total = min(total, limit)
    return MemoryReport(
        total_bytes=int(total),
        free_bytes=int(free),
        utilization=settings.utilization,
        kv_cache_bytes=settings.kv_cache_bytes,
        freed_bytes=freed_bytes,
        cgroup_limit_bytes=limit,
    )


def process_anonymous_bytes() -> int:
    """This process's anonymous resident memory (``RssAnon``: its heap and the libraries'
    private pages, not the files they map, which processes share); 0 where unknown."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    match = re.search(r"^RssAnon:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim``): the scratch
    of vLLM's warm-up passes is freed when they end but kept by the allocator, and the
    slots were sized on memory that does not count it. False where the C library has no
    such call (musl, macOS) or nothing was released."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
