"""The link's interface: what one transfer moves (:class:`ExpertCopy`), its handle
(:class:`Transfer`) and the copy engine (:class:`Link`); backends in :mod:`.cpu` and
:mod:`.cuda`."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_specexpert.tiers.store import ExpertSource


@dataclass
class ExpertCopy:
    """What one transfer moves: experts of one layer from the slow tier into slots."""

    source: ExpertSource
    """The layer's experts in the slow tier (host RAM or disk)."""
    destinations: dict[str, torch.Tensor]
    """Tensor name -> ``[slots, ...]`` slot pool (the same names, unless decoded)."""
    experts: np.ndarray
    """Expert ids to copy."""
    slots: np.ndarray
    """Their destination slots (distinct)."""
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = len(self.experts) * self.source.expert_nbytes

    @property
    def copies(self) -> int:
        """Tensor copies it takes one at a time: one per expert and tensor."""
        return len(self.experts) * self.source.num_tensors

    def run(self, device: torch.device | None = None) -> None:
        """Perform the copy: the source copies its experts into the slots (blocking, on
        the host; issued on the current stream of ``device`` on CUDA). A host copy's
        time teaches the source what its copies cost."""
        if device is not None:
            self.source.copy_into(self.experts, self.slots, self.destinations, device)
            return
        started = time.perf_counter()
        self.source.copy_into(self.experts, self.slots, self.destinations)
        self.source.copied(self.nbytes, time.perf_counter() - started)


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
    def submit(
        self,
        copy: ExpertCopy,
        prefetch: bool = False,
        on_start: StartCallback | None = None,
        after: Sequence = (),
    ) -> Transfer:
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

    def expert_seconds(self, experts: ExpertSource) -> float:
        """Expected link time of moving one expert of ``experts``: what its source has
        learned its copies cost, unless the link models its own time."""
        return experts.copy_seconds()

    def wait(self, transfer: Transfer) -> float:
        stalled = transfer.wait()
        self.stall_s += stalled
        return stalled

    def close(self) -> None:  # noqa: B027 - a hook: most links hold nothing to release
        """Release the link's resources (threads, streams)."""

    def _started(self, transfer: Transfer, copies: int) -> None:
        self.bytes_copied += transfer.nbytes
        self.copies += copies
        if transfer.on_start is not None:
            transfer.on_start(transfer)


def insert(pending: deque, transfer: Transfer) -> None:
    """Queue ``transfer``: prefetches at the end, demand ones after the last demand."""
    if transfer.prefetch:
        pending.append(transfer)
        return
    position = next((i for i, t in enumerate(pending) if t.prefetch), len(pending))
    pending.insert(position, transfer)


class Clock:
    """The time an emulated link holds its copies to: ``perf_counter`` seconds, and a
    wait until a moment of it. Another clock (a test's, moved by hand) makes whether an
    emulated copy has landed independent of how loaded the machine is."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep_until(self, deadline: float) -> None:
        sleep_until(deadline)


def sleep_until(deadline: float) -> None:
    # time.sleep overshoots by ~0.1 ms; spin for the last stretch so that emulated
    # copies of a few microseconds stay accurate.
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return
        if remaining > 2e-3:
            time.sleep(remaining - 1e-3)
