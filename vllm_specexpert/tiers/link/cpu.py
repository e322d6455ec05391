"""The CPU link: a copy worker thread, with optional bandwidth/latency emulation (see
:mod:`vllm_specexpert.tiers.link`)."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

from vllm_specexpert.config import LinkConfig
from vllm_specexpert.tiers.link.base import (
    ExpertCopy,
    Link,
    StartCallback,
    Transfer,
    insert,
    sleep_until,
)
from vllm_specexpert.tiers.store import ExpertSource, ExpertsUnreadable


class Clock:
    """The time the CPU link submits, starts and lands its copies in (``perf_counter``
    seconds); a test's clock makes landing independent of machine load."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep_until(self, deadline: float) -> None:
        sleep_until(deadline)


class _CpuTransfer(Transfer):
    def __init__(
        self, link: CpuLink, copy: ExpertCopy, prefetch: bool, on_start: StartCallback | None
    ) -> None:
        self.link = link
        self.copy = copy
        self.nbytes = copy.nbytes
        self.copies = copy.copies
        self.prefetch = prefetch
        self.on_start = on_start
        self.submitted_at = link.clock.now()
        self.ready_at: float | None = None
        """Emulated completion time, set when the emulated link starts it."""
        self.error: BaseException | None = None
        self.claim = threading.Lock()
        """Taken by whoever performs the real copy: the copy thread, the submitting
        thread (a demand copy), or a waiter that gets there first."""
        self.done = threading.Event()
        """Set once the real copy happened (or was skipped after a cancel)."""
        self.submitter_s = 0.0
        """A demand copy on a real link: the seconds its submitter spent copying (the
        wait for it, counted when it is waited for: the call could not go on without it)."""

    def perform(self) -> bool:
        """Do the real copy unless someone else claimed it; returns once it is done,
        True if this call did it."""
        if not self.claim.acquire(blocking=False):
            self.done.wait()
            return False
        try:
            if not self.cancelled:
                self.copy.run()
        except BaseException as exc:  # noqa: BLE001 - surfaced to the waiter
            self.error = exc
        self.done.set()
        return True

    def ready(self) -> bool:
        if not self.done.is_set():
            return False
        now = self.link.clock.now()
        self.link._advance(now)
        return self.ready_at is not None and self.ready_at <= now

    def wait(self) -> float:
        if self.cancelled:  # it would never land: a bookkeeping bug, not a slow link
            raise RuntimeError("specexpert: waited for a cancelled expert copy")
        link, clock = self.link, self.link.clock
        start = clock.now()
        self.perform()
        if isinstance(self.error, ExpertsUnreadable):
            raise self.error  # the engine runs the call without those experts
        if self.error is not None:
            raise RuntimeError("specexpert: expert copy failed") from self.error
        if link.emulated:  # (a real copy has landed once performed)
            while self.ready_at is None:  # queued behind others on the emulated link
                link._advance(clock.now())
                if self.ready_at is None:
                    clock.sleep_until(link._link_free_at)
            clock.sleep_until(self.ready_at)
        return clock.now() - start + self.submitter_s


class CpuLink(Link):
    """Copy worker thread with optional bandwidth/latency emulation (see module doc).
    ``clock``: the time transfers are submitted, start and land in (``perf_counter``)."""

    def __init__(self, config: LinkConfig, clock: Clock | None = None) -> None:
        super().__init__()
        self.config = config
        self.emulated = config.emulated
        """Whether copies are held to the modeled time (read once: a call's path asks)."""
        self.cancellable = config.emulated
        """Only the emulated link queues prefetches where they can be dropped; a real one
        hands each to the copy thread at once, so that a layer's prefetches go to the
        slow tier as one transfer (a disk reads them at its queue depth, not one by one)."""
        self.clock = clock or Clock()
        self._bytes_per_s = (config.bandwidth_gbps or 0.0) * 1e9
        self._latency_s = config.latency_us * 1e-6
        self._link_free_at = 0.0
        self._pending: deque[_CpuTransfer] = deque()
        """Emulated transfers not started yet, in link order."""
        self._jobs: queue.SimpleQueue[_CpuTransfer | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._copy_loop, name="specexpert-copy", daemon=True)
        self._thread.start()

    def submit(
        self,
        copy: ExpertCopy,
        prefetch: bool = False,
        on_start: StartCallback | None = None,
        after: Sequence = (),
        ahead: bool = False,
    ) -> Transfer:
        transfer = _CpuTransfer(self, copy, prefetch, on_start)
        if self.emulated:
            self._advance(transfer.submitted_at)
            insert(self._pending, transfer)
            self._advance(transfer.submitted_at)
        else:
            transfer.ready_at = transfer.submitted_at
            self._started(transfer, transfer.copies)
        if prefetch or ahead:
            self._jobs.put(transfer)
        else:  # waited for at once: copied in the caller's thread, no hand-off
            started = self.clock.now()
            transfer.perform()
            if not self.emulated:  # (emulated: the link's modeled time is the wait)
                transfer.submitter_s = self.clock.now() - started
        return transfer

    def cancel(self, transfer: Transfer) -> bool:
        self._advance(self.clock.now())
        if isinstance(transfer, _CpuTransfer) and transfer in self._pending:
            self._pending.remove(transfer)
            transfer.cancelled = True
            # Skip the real copy if nobody started it, else let it finish, so that it
            # cannot land on a slot that is reused from now on.
            transfer.perform()
            return True
        return False

    def retire(self, transfer: Transfer) -> None:
        if not self.cancel(transfer):
            assert isinstance(transfer, _CpuTransfer), "a link retires its own transfers"
            transfer.perform()  # a waiter may overtake the copy thread: finish it first

    def idle(self) -> bool:
        now = self.clock.now()
        if self.emulated:
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
        """The emulated link's time (its latency and bandwidth)."""
        return self._latency_s * copies + nbytes / self._bytes_per_s

    def expert_seconds(self, experts: ExpertSource) -> float:
        if self.emulated:
            return self.copy_seconds(experts.expert_nbytes, experts.num_tensors)
        return super().expert_seconds(experts)

    def _copy_loop(self) -> None:
        while True:
            transfer = self._jobs.get()
            if transfer is None:
                return
            transfer.perform()  # (its source learns what the copy cost)

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=5)
