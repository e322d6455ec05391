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
        """One per expert and tensor."""
        return len(self.experts) * self.source.num_tensors

    def run(self, device: torch.device | None = None) -> None:
        """Blocking on the host (whose time teaches the source its copy cost); on CUDA
        issued on ``device``'s current stream."""
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
        """Block the compute until the data is usable; returns host stall seconds."""

    @abstractmethod
    def ready(self) -> bool:
        """Never blocks."""


class Link(ABC):
    """Moves experts from the slow tier to device slots, one copy engine's worth."""

    cancellable = True
    """Prefetches wait in a host queue, cancellable until they start."""

    def __init__(self) -> None:
        self.bytes_copied = 0
        """Bytes of started transfers (cancelled prefetches never count)."""
        self.copies = 0
        self.stall_s = 0.0

    @abstractmethod
    def submit(
        self,
        copy: ExpertCopy,
        prefetch: bool = False,
        on_start: StartCallback | None = None,
        after: Sequence = (),
        ahead: bool = False,
    ) -> Transfer:
        """Queue ``copy``; returns at once. ``on_start(transfer)`` when it starts moving.
        ``after``: earlier transfers into the destination slots and events of the last
        kernels that read them, which the copy must follow (CUDA only). ``ahead``: a
        demand copy a later launch needs, not waited for at once (a link that would copy
        a demand in the caller's thread hands it off, so that it moves while the caller
        computes)."""

    def cancel(self, transfer: Transfer) -> bool:
        """Drop a prefetch not yet started; if it was, its destination holds nothing."""
        return False

    def retire(self, transfer: Transfer) -> None:
        """``transfer``'s destination is about to be reused: it must not land after later copies."""
        self.cancel(transfer)

    @abstractmethod
    def idle(self) -> bool:
        """No transfer is queued or moving (a background load would delay nothing)."""

    @abstractmethod
    def copy_seconds(self, nbytes: int, copies: int) -> float:
        """Expected link time of one transfer of ``copies`` tensors, ``nbytes`` in all."""

    def reset_counters(self) -> None:
        self.bytes_copied = 0
        self.copies = 0
        self.stall_s = 0.0

    def expert_seconds(self, experts: ExpertSource) -> float:
        """Seconds per expert: the source's learned cost, unless the link models its own."""
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


def sleep_until(deadline: float) -> None:
    # time.sleep overshoots by ~0.1 ms; spin for the last stretch so that emulated
    # copies of a few microseconds stay accurate.
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return
        if remaining > 2e-3:
            time.sleep(remaining - 1e-3)
