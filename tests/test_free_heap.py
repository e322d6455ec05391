"""The C heap's free pages go back to the OS after vLLM's warm-up
(:func:`~vllm_specexpert.tiers.memory.release_free_heap`); a process's own memory is
its anonymous pages, not the files it maps
(:func:`~vllm_specexpert.tiers.memory.process_anonymous_bytes`)."""

import ctypes
import mmap

import pytest

from vllm_specexpert.tiers.memory import process_anonymous_bytes, release_free_heap

BLOCK = 64 * 1024
"""Below glibc's mmap threshold (128 KiB): served from the heap, not a mapping of its own."""
BLOCKS = 1600  # 100 MiB


def anonymous_kib() -> int:
    return process_anonymous_bytes() // 1024


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


def test_a_process_counts_the_memory_it_writes_not_the_files_it_reads(tmp_path):
    # What the engine's processes are counted to hold (each at this process's anonymous
    # memory) must not count a mapped file's pages, which the page cache holds once for
    # every process (a resident-set count would: the fault this catches).
    size = 100 << 20
    path = tmp_path / "file"
    path.write_bytes(b"\1" * size)
    before = process_anonymous_bytes()
    with path.open("rb") as file, mmap.mmap(file.fileno(), size, prot=mmap.PROT_READ) as pages:
        assert sum(pages[i] for i in range(0, size, 4096)) == size // 4096  # read in
        assert process_anonymous_bytes() - before < 0.1 * size
    written = bytearray(b"\1" * size)
    assert process_anonymous_bytes() - before >= 0.9 * size
    del written
