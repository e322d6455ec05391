"""The C heap's free pages go back to the OS after vLLM's warm-up
(:func:`~vllm_specexpert.tiers.memory.release_free_heap`)."""

import ctypes
from pathlib import Path

import pytest

from vllm_specexpert.tiers.memory import release_free_heap

BLOCK = 64 * 1024
"""Below glibc's mmap threshold (128 KiB): served from the heap, not a mapping of its own."""
BLOCKS = 1600  # 100 MiB


def anonymous_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


def test_the_heaps_free_pages_are_given_back():
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "malloc_trim"):
        pytest.skip("this C library has no malloc_trim (not glibc): nothing to release")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    *blocks, fence = (libc.malloc(BLOCK) for _ in range(BLOCKS + 1))
    # The last block stays: the freed ones are not the heap's top, which free() trims.
    for block in blocks:
        ctypes.memset(block, 1, BLOCK)  # resident
    for block in blocks:
        libc.free(block)
    held = anonymous_kib()
    assert release_free_heap()
    released = held - anonymous_kib()
    libc.free(fence)
    # Nearly all of the 100 MiB freed comes back (the allocator's bookkeeping stays).
    assert released >= 0.9 * BLOCKS * BLOCK / 1024
