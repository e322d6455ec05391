"""The link between the slow tier and the device cache.

One copy engine's worth of transfers, with two kinds of requests: *demand* copies (the
layer that is running needs them now) and *prefetches* (a prediction for the next layer).
Both backends keep prefetches that have not started in a host-side queue, so that a
demand copy goes ahead of them and an unneeded one can still be dropped
(:meth:`Link.cancel`); started copies are never interrupted, like a real DMA engine.

* :class:`CpuLink` (CPU build, tests, benchmarks): one copy worker thread performs every
  copy for real (a prefetch's bytes may land before its emulated start; a cancelled one
  never lands after :meth:`Link.cancel` returned). With an emulated bandwidth/latency the
  link is modeled as a single engine: a transfer starts when the link is free (demand
  ones first), takes ``latency * copies + bytes / bandwidth``, and its data counts as
  usable only from then. The consumer waits for that moment in :meth:`Transfer.wait`, so
  the emulation holds the compute exactly where a GPU would stall, without burning the
  copy thread.
* :class:`CudaLink`: two copy streams over pinned host memory (demand copies on a
  high-priority one, prefetches on a low-priority one), issued the moment they are
  submitted, one launch per transfer (:func:`~vllm_specexpert.triton_kernels.slots.
  copy_experts`), one event each; waiting is a stream-side ``wait_event`` (no host
  sync). A copy is ordered only after what it must follow: the kernels that last read
  its destination slots and the earlier copies into them (``after``), never after the
  whole compute stream. Issued prefetches cannot be cancelled. NOT RUN ON A GPU YET:
  written against PyTorch's stream/event API, exercised here only by review.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_specexpert.config import LinkConfig


@dataclass
class ExpertCopy:
    """What one transfer moves: experts of one layer from the slow tier into slots."""

    sources: dict[str, torch.Tensor]
    """Tensor name -> ``[E, ...]`` slow-tier tensor."""
    destinations: dict[str, torch.Tensor]
    """Tensor name -> ``[slots, ...]`` slot pool (same names)."""
    experts: np.ndarray
    """Expert ids to copy."""
    slots: np.ndarray
    """Their destination slots (distinct)."""
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = len(self.experts) * sum(
            t[0].numel() * t.element_size() for t in self.sources.values())

    @property
    def copies(self) -> int:
        """Tensor copies it takes one at a time: one per expert and tensor."""
        return len(self.experts) * len(self.sources)

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(slot view, slow-tier view)`` per expert and tensor."""
        return [
            (self.destinations[key][slot], src[expert])
            for expert, slot in zip(self.experts.tolist(), self.slots.tolist())
            for key, src in self.sources.items()
        ]


StartCallback = Callable[["Transfer"], None]
"""Called once when a transfer starts moving on the link (never for a dropped one)."""


class Transfer(ABC):
    """Handle of one submitted transfer."""

    nbytes: int
    prefetch: bool
    cancelled: bool = False
    on_start: StartCallback | None = None

    @abstractmethod
    def wait(self) -> float:
        """Block the compute until the copied data is usable. Returns the seconds the
        host stalled (0.0 where the wait is stream-side)."""

    @abstractmethod
    def ready(self) -> bool:
        """Whether the copied data is usable now (never blocks)."""


class Link(ABC):
    """Moves experts from the slow tier to device slots, one copy engine's worth."""

    cancellable = True
    """Whether a submitted prefetch can wait in a host queue, cancellable until it
    starts (else it is issued at once, and ``cancel`` never succeeds)."""

    def __init__(self) -> None:
        self.bytes_copied = 0
        """Bytes of started transfers (cancelled prefetches never count)."""
        self.copies = 0
        """Tensor copies of started transfers."""
        self.stall_s = 0.0
        """Seconds callers waited in :meth:`wait`."""

    @abstractmethod
    def submit(self, copy: ExpertCopy, prefetch: bool = False,
               on_start: StartCallback | None = None, after: Sequence = ()) -> Transfer:
        """Queue ``copy``; returns at once. Demand transfers go ahead of prefetches that
        have not started. ``on_start(transfer)`` is called when the copy starts moving
        (the link is the one that observes it). ``after``: transfers retired from the
        destination slots and device events of the last kernels that read them; the
        copy must not start before them (the CPU link has nothing to order: retiring
        finishes a copy, and host kernels are synchronous)."""

    def cancel(self, transfer: Transfer) -> bool:
        """Drop a prefetch that has not started. Returns whether it was dropped; the
        caller must then treat its destination as holding nothing."""
        return False

    def retire(self, transfer: Transfer) -> None:
        """The destination of ``transfer`` is about to be reused for something else:
        drop it if it has not started, and make sure it cannot land after later copies
        to the same place."""
        self.cancel(transfer)

    @abstractmethod
    def idle(self) -> bool:
        """Whether no transfer is queued or moving now (a background load would not
        delay anything)."""

    @abstractmethod
    def copy_seconds(self, nbytes: int, copies: int) -> float:
        """Expected link time of one transfer of ``copies`` tensors, ``nbytes`` in all."""

    def reset_counters(self) -> None:
        self.bytes_copied = 0
        self.copies = 0
        self.stall_s = 0.0

    def expert_seconds(self, experts) -> float:
        """Expected link time of moving one expert of ``experts`` (a LayerExperts)."""
        return self.copy_seconds(experts.expert_nbytes, len(experts.tensors))

    def wait(self, transfer: Transfer) -> float:
        stalled = transfer.wait()
        self.stall_s += stalled
        return stalled

    def close(self) -> None:
        """Release the link's resources (threads, streams)."""

    def _started(self, transfer: Transfer, copies: int) -> None:
        self.bytes_copied += transfer.nbytes
        self.copies += copies
        if transfer.on_start is not None:
            transfer.on_start(transfer)


def _insert(pending: deque, transfer: Transfer) -> None:
    """Queue ``transfer``: prefetches at the end, demand ones after the last demand."""
    if transfer.prefetch:
        pending.append(transfer)
        return
    position = next((i for i, t in enumerate(pending) if t.prefetch), len(pending))
    pending.insert(position, transfer)


# --------------------------------------------------------------------------- CPU


class _CpuTransfer(Transfer):
    def __init__(self, link: CpuLink, copy: ExpertCopy, prefetch: bool,
                 on_start: StartCallback | None):
        self.link = link
        self.pairs = copy.pairs()
        self.nbytes = copy.nbytes
        self.copies = copy.copies
        self.prefetch = prefetch
        self.on_start = on_start
        self.submitted_at = time.perf_counter()
        self.ready_at: float | None = None
        """Emulated completion time, set when the emulated link starts it."""
        self.error: BaseException | None = None
        if prefetch:
            self.claim = threading.Lock()
            """Taken by whoever performs the real copy: the copy thread, or a waiter
            that gets there first."""
            self.done = threading.Event()
            """Set once the real copy happened (or was skipped after a cancel)."""
        else:
            # A demand copy is waited for at once: it is done here, in the caller's
            # thread, without a hand-off to the copy thread.
            self.claim = self.done = None
            self._copy()

    def _copy(self) -> None:
        try:
            if not self.cancelled:
                for dst, src in self.pairs:
                    dst.copy_(src)
        except BaseException as exc:  # surfaced to the waiter
            self.error = exc

    def perform(self) -> bool:
        """Do the real copy unless someone else claimed it (or it was a demand copy,
        done at submission); returns once it is done, True if this call did it."""
        if self.claim is None:
            return False
        if not self.claim.acquire(blocking=False):
            self.done.wait()
            return False
        self._copy()
        self.done.set()
        return True

    def ready(self) -> bool:
        if self.done is not None and not self.done.is_set():
            return False
        now = time.perf_counter()
        self.link._advance(now)
        return self.ready_at is not None and self.ready_at <= now

    def wait(self) -> float:
        if self.cancelled:  # it would never land: a bookkeeping bug, not a slow link
            raise RuntimeError("specexpert: waited for a cancelled expert copy")
        start = time.perf_counter()
        self.perform()
        if self.error is not None:
            raise RuntimeError("specexpert: expert copy failed") from self.error
        while self.ready_at is None:  # queued behind others on the emulated link
            self.link._advance(time.perf_counter())
            if self.ready_at is None:
                sleep_until(self.link._link_free_at)
        sleep_until(self.ready_at)
        return time.perf_counter() - start


def sleep_until(deadline: float) -> None:
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
        self._pending: deque[_CpuTransfer] = deque()
        """Emulated transfers not started yet, in link order."""
        self._seconds_per_byte = 1e-10
        """Measured memcpy cost (real copies without emulation), running mean."""
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._copy_loop, name="specexpert-copy", daemon=True
        )
        self._thread.start()

    def submit(self, copy: ExpertCopy, prefetch: bool = False,
               on_start: StartCallback | None = None, after: Sequence = ()) -> Transfer:
        transfer = _CpuTransfer(self, copy, prefetch, on_start)
        if self.config.emulated:
            self._advance(transfer.submitted_at)
            _insert(self._pending, transfer)
            self._advance(transfer.submitted_at)
        else:
            transfer.ready_at = transfer.submitted_at
            self._started(transfer, transfer.copies)
        if prefetch:
            self._jobs.put(transfer)
        return transfer

    def cancel(self, transfer: Transfer) -> bool:
        self._advance(time.perf_counter())
        if transfer in self._pending:
            self._pending.remove(transfer)
            transfer.cancelled = True
            # Skip the real copy if nobody started it, else let it finish, so that it
            # cannot land on a slot that is reused from now on.
            transfer.perform()
            return True
        return False

    def retire(self, transfer: Transfer) -> None:
        if not self.cancel(transfer):
            transfer.perform()  # a waiter may overtake the copy thread: finish it first

    def idle(self) -> bool:
        now = time.perf_counter()
        if self.config.emulated:
            self._advance(now)
            return not self._pending and self._link_free_at <= now
        return self._jobs.empty()

    def _advance(self, now: float) -> None:
        """Start, in order, every queued transfer the emulated link reached by ``now``."""
        while self._pending and self._link_free_at <= now:
            transfer = self._pending.popleft()
            start = max(self._link_free_at, transfer.submitted_at)
            transfer.ready_at = start + self.copy_seconds(transfer.nbytes, transfer.copies)
            self._link_free_at = transfer.ready_at
            self._started(transfer, transfer.copies)

    def copy_seconds(self, nbytes: int, copies: int) -> float:
        if self.config.emulated:
            return self._latency_s * copies + nbytes / self._bytes_per_s
        return nbytes * self._seconds_per_byte

    def _copy_loop(self) -> None:
        while True:
            transfer = self._jobs.get()
            if transfer is None:
                return
            start = time.perf_counter()
            if transfer.perform() and transfer.nbytes and not transfer.cancelled:
                measured = (time.perf_counter() - start) / transfer.nbytes
                self._seconds_per_byte = 0.9 * self._seconds_per_byte + 0.1 * measured

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=5)


# -------------------------------------------------------------------------- CUDA


class _CudaTransfer(Transfer):
    def __init__(self, copy: ExpertCopy, prefetch: bool, on_start: StartCallback | None):
        self.nbytes = copy.nbytes
        self.prefetch = prefetch
        self.on_start = on_start
        self.event = torch.cuda.Event()
        """Recorded on the copy stream right after the copy."""

    def ready(self) -> bool:
        return self.event.query()

    def wait(self) -> float:
        # Stream-side dependency: kernels queued after this point on the compute
        # stream start once the copy is done. No host synchronization.
        torch.cuda.current_stream().wait_event(self.event)
        return 0.0


CUDA_ASSUMED_GBPS = 20.0
"""Host-to-device bandwidth the CUDA link assumes when estimating a copy's duration
(PCIe 4.0 x16 with pinned memory moves about 20-25 GB/s). Not measured: an estimate."""


class CudaLink(Link):
    """Demand and prefetch copy streams over pinned host memory (see module doc). Not
    yet run on a GPU."""

    cancellable = False

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        # Lower number = higher priority: the copy a kernel is waiting for goes first
        # where both streams have work (copy_experts runs on SMs, so this matters).
        low, high = torch.cuda.Stream.priority_range()
        self.demand_stream = torch.cuda.Stream(device=device, priority=high)
        self.prefetch_stream = torch.cuda.Stream(device=device, priority=low)
        self._last: dict[bool, _CudaTransfer] = {}
        """Prefetch flag -> the last transfer issued on that stream."""
        self._device_views: dict[int, torch.Tensor] = {}
        """Slow-tier tensor data pointer -> its UVA device view (copy_experts reads it)."""

    def copy_seconds(self, nbytes: int, copies: int) -> float:
        # One launch per transfer: the per-copy cost is a launch, not a memcpy call.
        return 5e-6 + nbytes / (CUDA_ASSUMED_GBPS * 1e9)

    def submit(self, copy: ExpertCopy, prefetch: bool = False,
               on_start: StartCallback | None = None, after: Sequence = ()) -> Transfer:
        transfer = _CudaTransfer(copy, prefetch, on_start)
        stream = self.prefetch_stream if prefetch else self.demand_stream
        for dependency in after:
            event = dependency.event if isinstance(dependency, Transfer) else dependency
            stream.wait_event(event)
        with torch.cuda.stream(stream):
            self._copy(copy)
            transfer.event.record(stream)
        self._last[prefetch] = transfer
        self._started(transfer, 1)
        return transfer

    def idle(self) -> bool:
        return all(t.event.query() for t in self._last.values())

    def close(self) -> None:
        """Nothing may still be copying into a slot pool that is about to be freed
        (``reconfigure`` closes the link, then drops the pools)."""
        self.demand_stream.synchronize()
        self.prefetch_stream.synchronize()

    def _copy(self, copy: ExpertCopy) -> None:
        """One launch for every expert and tensor of ``copy`` where the layer has the
        two tensors of a fused MoE (w13, w2); else one async memcpy per pair."""
        if len(copy.sources) != 2:
            for dst, src in copy.pairs():
                dst.copy_(src, non_blocking=True)
            return
        from vllm_specexpert.triton_kernels.slots import copy_experts

        from vllm_specexpert.staging import upload

        index = upload(np.stack([copy.experts, copy.slots]).astype(np.int32), self.device)
        copy_experts(tuple(self._device_view(t) for t in copy.sources.values()),
                     tuple(copy.destinations[k] for k in copy.sources), index[0], index[1])

    def _device_view(self, host: torch.Tensor) -> torch.Tensor:
        view = self._device_views.get(host.data_ptr())
        if view is None:
            from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

            view = self._device_views[host.data_ptr()] = get_accelerator_view_from_cpu_tensor(host)
        return view


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
