"""Slot rows shared by every layer (the CPU build): the experts a layer call streams live
in one region of memory that each layer's slot tensors cover after the layer's own rows.

vLLM's CPU kernel takes one weight tensor per layer and indexes its rows by slot id, and
rounds a token's sum once per launch: so that a call whose experts do not all fit in the
layer's own slots still runs in one launch (exact), the rows it reads its missing experts
into must be rows of that same tensor. Layers run one at a time, so those rows can be the
same memory for every layer: per weight name a ``memfd`` of ``rows`` rows, mapped right
after each layer's own rows (``MAP_FIXED`` over a reserved range), so that a layer's
tensor ``[own + rows, ...]`` is contiguous and its last ``rows`` rows are every layer's.
With L layers, S slots a layer of the budget's memory and E experts a layer, ``S' = (L*S
- E) / (L - 1)`` own rows a layer leave ``E - S'`` rows for the region: any call's missing
experts fit (docs/design.md, "Tokens per byte").

The region starts on a page (a mapping does); a layer's own rows end there, so its
tensor starts ``own * row`` bytes before it (on a page where the row is a whole number
of pages, as experts of real models are; elsewhere a disk read bounces, as it does into
any unaligned slot)."""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref

import torch

from vllm_specexpert.tiers.store import SlotShapes

PAGE = mmap.PAGESIZE
_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_POPULATE = 0x8000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class RegionRefused(OSError):
    """The kernel would not make the shared region (no ``memfd_create``, no memory)."""


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def _mmap(address: int | None, length: int, prot: int, flags: int, fd: int = -1) -> int:
    got = _libc.mmap(address, length, prot, flags, fd, 0)
    if got is None or got == _MAP_FAILED:
        number = ctypes.get_errno()
        raise RegionRefused(number, f"mmap of {length} bytes: {os.strerror(number)}")
    return int(got)


class SharedRegion:
    """``rows`` slot rows of every weight of ``shapes``, shared by the layers whose slot
    tensors :meth:`views` makes (module doc)."""

    def __init__(self, rows: int, shapes: SlotShapes) -> None:
        if rows < 1:
            raise ValueError(f"a shared region needs at least one row, got {rows}")
        self.rows = rows
        self.shapes = dict(shapes)
        self.files: dict[str, int] = {}
        """Weight name -> the memfd its region rows live in."""
        try:
            for name, (shape, dtype) in self.shapes.items():
                fd = os.memfd_create(f"specexpert-region-{name}", os.MFD_CLOEXEC)
                self.files[name] = fd
                os.ftruncate(fd, _pages(rows * _row_nbytes(shape, dtype)))
        except OSError as error:
            self.close()
            raise RegionRefused(
                error.errno, f"memfd for the shared region: {error.strerror}"
            ) from None

    @property
    def nbytes(self) -> int:
        """The region's memory: its rows of every weight."""
        return sum(
            _pages(self.rows * _row_nbytes(shape, dtype)) for shape, dtype in self.shapes.values()
        )

    def views(self, own_rows: int) -> dict[str, torch.Tensor]:
        """A layer's slot tensors: per weight ``[own_rows + rows, ...]``, its first
        ``own_rows`` rows its own (zeroed), the rest the region. The mappings are
        undone when the last tensor on them is gone."""
        return {name: self._view(name, own_rows) for name in self.shapes}

    def _view(self, name: str, own_rows: int) -> torch.Tensor:
        shape, dtype = self.shapes[name]
        row = _row_nbytes(shape, dtype)
        own = _pages(own_rows * row)
        shared = _pages(self.rows * row)
        base = _mmap(None, own + shared, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            # Populated now: every layer maps the region's pages, and a page first touched
            # through a mapping faults there, once per layer (a million minor faults on an
            # 8-layer miniature, which slowed the first minutes' reads by a fifth); the
            # memory is the budget's, so it is better taken at start.
            rw = mmap.PROT_READ | mmap.PROT_WRITE
            fixed = _MAP_FIXED | _MAP_POPULATE
            if own:
                _mmap(base, own, rw, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | fixed)
            _mmap(base + own, shared, rw, mmap.MAP_SHARED | fixed, self.files[name])
        except RegionRefused:
            _libc.munmap(base, own + shared)
            raise
        start = base + own - own_rows * row
        memory = (ctypes.c_char * ((own_rows + self.rows) * row)).from_address(start)
        weakref.finalize(memory, _libc.munmap, base, own + shared)
        flat = torch.frombuffer(memory, dtype=torch.uint8)
        return flat.view(dtype).view(own_rows + self.rows, *shape)

    def close(self) -> None:
        """Close the region's files (the memory goes with the last view on it)."""
        for fd in self.files.values():
            os.close(fd)
        self.files = {}


def _row_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for n in shape:
        count *= n
    return count * dtype.itemsize


__all__ = ["RegionRefused", "SharedRegion"]
