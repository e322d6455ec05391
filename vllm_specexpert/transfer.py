"""The link between the slow tier and the device cache.

Two backends behind one interface (:class:`Link`):

* :class:`CpuLink` (CPU build, tests, benchmarks): one copy worker thread performs every
  copy for real, in submission order, like a single copy engine. With an emulated
  bandwidth/latency, a copy becomes *usable* only once the emulated link would have
  delivered it: ``ready_at = max(submitted, link_free_at) + latency + bytes / bandwidth``.
  The consumer waits for that moment in :meth:`Transfer.wait`, so the emulation holds the
  compute exactly where a GPU would stall, without burning the copy thread.
* :class:`CudaLink`: a dedicated copy stream, pinned host memory, and one event per
  transfer; waiting is a stream-side ``wait_event`` (no host sync). NOT RUN ON A GPU YET:
  written against PyTorch's stream/event API, exercised here only by review.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from vllm_specexpert.config import LinkConfig

CopyPairs = Sequence[tuple[torch.Tensor, torch.Tensor]]
"""``(destination slot view, source slow-tier view)`` pairs of one transfer."""


class Transfer(ABC):
    """Handle of one submitted transfer."""

    nbytes: int

    @abstractmethod
    def wait(self) -> float:
        """Block the compute until the copied data is usable. Returns the seconds the
        host stalled (0.0 where the wait is stream-side)."""


class Link(ABC):
    """Moves experts from the slow tier to device slots, one copy engine's worth."""

    def __init__(self) -> None:
        self.bytes_copied = 0
        self.copies = 0
        self.stall_s = 0.0

    @abstractmethod
    def submit(self, pairs: CopyPairs) -> Transfer:
        """Start copying every pair; returns at once."""

    @abstractmethod
    def copy_seconds(self, nbytes: int, copies: int) -> float:
        """Expected link time of one transfer of ``copies`` tensors, ``nbytes`` in all."""

    def expert_seconds(self, experts) -> float:
        """Expected link time of moving one expert of ``experts`` (a LayerExperts)."""
        return self.copy_seconds(experts.expert_nbytes, len(experts.tensors))

    def wait(self, transfer: Transfer) -> float:
        stalled = transfer.wait()
        self.stall_s += stalled
        return stalled

    def close(self) -> None:
        """Release the link's resources (threads, streams)."""

    @staticmethod
    def _nbytes(pairs: CopyPairs) -> int:
        return sum(src.numel() * src.element_size() for _, src in pairs)


# --------------------------------------------------------------------------- CPU


class _CpuTransfer(Transfer):
    def __init__(self, nbytes: int, ready_at: float):
        self.nbytes = nbytes
        self.ready_at = ready_at
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> float:
        start = time.perf_counter()
        self.done.wait()
        if self.error is not None:
            raise RuntimeError("specexpert: expert copy failed") from self.error
        _sleep_until(self.ready_at)
        return time.perf_counter() - start


def _sleep_until(deadline: float) -> None:
    # time.sleep overshoots by ~0.1 ms; spin for the last stretch so that emulated
    # copies of a few microseconds stay accurate.
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return
        if remaining > 2e-3:
            time.sleep(remaining - 1e-3)


class CpuLink(Link):
    """Copy worker thread with optional bandwidth/latency emulation (see module doc)."""

    def __init__(self, config: LinkConfig):
        super().__init__()
        self.config = config
        self._bytes_per_s = (config.bandwidth_gbps or 0.0) * 1e9
        self._latency_s = config.latency_us * 1e-6
        self._link_free_at = 0.0
        self._seconds_per_byte = 1e-10
        """Measured memcpy cost (real copies without emulation), running mean."""
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._copy_loop, name="specexpert-copy", daemon=True
        )
        self._thread.start()

    def submit(self, pairs: CopyPairs) -> Transfer:
        nbytes = self._nbytes(pairs)
        now = time.perf_counter()
        if self.config.emulated:
            start = max(now, self._link_free_at)
            ready_at = start + self._latency_s * len(pairs) + nbytes / self._bytes_per_s
            self._link_free_at = ready_at
        else:
            ready_at = now
        transfer = _CpuTransfer(nbytes, ready_at)
        self._jobs.put((list(pairs), transfer))
        self.bytes_copied += nbytes
        self.copies += len(pairs)
        return transfer

    def copy_seconds(self, nbytes: int, copies: int) -> float:
        if self.config.emulated:
            return self._latency_s * copies + nbytes / self._bytes_per_s
        return nbytes * self._seconds_per_byte

    def _copy_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            pairs, transfer = job
            start = time.perf_counter()
            try:
                for dst, src in pairs:
                    dst.copy_(src)
            except BaseException as exc:  # surfaced to the waiter
                transfer.error = exc
            if transfer.nbytes:
                measured = (time.perf_counter() - start) / transfer.nbytes
                self._seconds_per_byte = 0.9 * self._seconds_per_byte + 0.1 * measured
            transfer.done.set()

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=5)


# -------------------------------------------------------------------------- CUDA


class _CudaTransfer(Transfer):
    def __init__(self, nbytes: int, event: torch.cuda.Event):
        self.nbytes = nbytes
        self.event = event

    def wait(self) -> float:
        # Stream-side dependency: kernels queued after this point on the compute
        # stream start once the copies are done. No host synchronization.
        torch.cuda.current_stream().wait_event(self.event)
        return 0.0


CUDA_ASSUMED_GBPS = 20.0
"""Host-to-device bandwidth the CUDA link assumes when estimating a copy's duration
(PCIe 4.0 x16 with pinned memory moves about 20-25 GB/s). Not measured: an estimate."""


class CudaLink(Link):
    """Copy stream + events over pinned host memory. Not yet run on a GPU."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def copy_seconds(self, nbytes: int, copies: int) -> float:
        return 5e-6 * copies + nbytes / (CUDA_ASSUMED_GBPS * 1e9)

    def submit(self, pairs: CopyPairs) -> Transfer:
        nbytes = self._nbytes(pairs)
        event = torch.cuda.Event()
        # A slot being overwritten may still be read by kernels already queued on the
        # compute stream (its previous expert): order the copies after them.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event.record(self.stream)
        self.bytes_copied += nbytes
        self.copies += len(pairs)
        return _CudaTransfer(nbytes, event)


def make_link(config: LinkConfig, device: torch.device) -> Link:
    """The link for ``device``: CUDA copy stream on a GPU, copy thread on CPU."""
    if device.type == "cuda":
        if config.emulated:
            from vllm_specexpert.config import SpecExpertConfigError

            raise SpecExpertConfigError(
                "link.bandwidth_gbps",
                "link emulation is for CPU runs; on CUDA the real copy engine is used",
                "remove 'link' from the config on GPU machines",
            )
        return CudaLink(device)
    return CpuLink(config)
