"""ExpertLoader: copies into one layer's slots over the link, and the copies in flight.

The loader is the only thing that writes slots after warm start. It asks the
:class:`ExpertCache` for slots (evicting by its policy), records the new residency,
submits the copy to the :class:`Link`, and records in the :class:`SlotPool` which slot
still waits for which copy (in a shared pool a victim's copy may belong to another
layer's loader):

* using a slot whose copy has not landed waits for it (counted as stall);
* reusing a slot for another expert first retires its copy (dropped if it has not
  started, else finished now), so that an old copy can never land on a new expert; on
  CUDA, where nothing blocks, the new copy is ordered instead after the slot's previous
  copy and after the last kernel that read the slot (per-slot events);
* prefetched experts stay protected from eviction until the layer's next call starts
  (:meth:`begin_run`), which counts them as used, drops them from the link if they have
  not started and are not needed, or counts them as unused.

Counters go to the ``stats`` each call is given, those of the phase the caller runs
(decode or prefill), and each is counted by whoever observes the event: requests, hits,
misses, stall, evictions and prefetch outcomes here; copies and bytes when the link
starts a copy (a dropped prefetch never counts as moved).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_specexpert.stats import PhaseStats
from vllm_specexpert.tiers.cache import ExpertCache
from vllm_specexpert.tiers.link import Link, Transfer


class ExpertLoader:
    """Loads one layer's experts into its :class:`ExpertCache` (see module doc)."""

    def __init__(self, cache: ExpertCache, link: Link) -> None:
        self.cache = cache
        self.link = link
        self.prefetches: dict[int, Transfer] = {}
        """Protected expert -> its prefetch (cancellable until it starts)."""

    @property
    def in_flight(self) -> dict[int, Transfer]:
        """Pool slot -> the copy into it that nobody has waited for yet (the pool's:
        in a shared pool, other layers' copies too)."""
        return self.cache.pool.in_flight

    # ------------------------------------------------------------------ queries

    def ready_mask(self) -> np.ndarray:
        """Resident experts whose data is usable now: copies that have not landed yet
        are left out (a policy that can compute them elsewhere need not wait)."""
        cache = self.cache
        mask = cache.resident_mask()
        for slot, transfer in self.in_flight.items():
            if cache.slot_expert[slot] >= 0 and not transfer.ready():
                mask[cache.slot_expert[slot]] = False
        return mask

    # ------------------------------------------------------------------ loading

    def acquire(
        self, experts: np.ndarray, stats: PhaseStats, future_demand: np.ndarray | None = None
    ) -> None:
        """Make every expert of ``experts`` (distinct ids, which must fit, see
        :meth:`ExpertCache.capacity_for`) resident and usable, loading the missing ones,
        and count the request. Part of a layer call: :meth:`begin_run` has released the
        call's prefetches first (protected experts are never evicted). Victims are never
        among ``experts``; ``future_demand`` (per-expert count of later uses in the same
        batch) keeps the most needed ones. Experts still in flight from a prefetch count
        as hits; waiting for them counts as stall."""
        cache = self.cache
        missing = experts[cache.expert_slot[experts] < 0]
        stats.requests += len(experts)
        stats.misses += len(missing)
        stats.hits += len(experts) - len(missing)
        if len(missing):
            slots = self._take_slots(len(missing), experts, stats, demand=future_demand)
            self._load(missing, slots, stats, prefetch=False)
        self._wait_for(experts, stats)
        cache.touch(experts)

    def count_resident(
        self, count: int, stats: PhaseStats, experts: np.ndarray | None = None
    ) -> None:
        """Count a launch on ``count`` distinct experts that are all resident and landed,
        as :meth:`acquire` would without its loads and waits (the resident fast paths);
        ``experts``, if known on the host, are marked used (eviction order)."""
        stats.requests += count
        stats.hits += count
        if experts is not None:
            self.cache.touch(experts)

    def prefetch(self, experts: np.ndarray, stats: PhaseStats, admitted: bool = False) -> int:
        """Queue loads of ``experts`` (distinct ids, most wanted first) ahead of use, in
        that order: one transfer each where the link can cancel a queued transfer, else
        one for all (one launch on CUDA). Resident ones are skipped; at most as many as
        the pool leaves room for (:meth:`SlotPool.prefetch_room`; the least wanted are
        dropped). Loaded experts are protected from eviction until the layer's next call starts
        (:meth:`begin_run`). Returns how many experts were queued."""
        cache = self.cache
        missing = experts[cache.expert_slot[experts] < 0]
        if not len(missing):
            return 0
        missing = missing[: cache.pool.prefetch_room(cache, experts)]
        if not len(missing):
            return 0
        slots = self._take_slots(len(missing), experts, stats)
        self.prefetches.update(
            zip(missing.tolist(), self._load_ahead(missing, slots, stats, admitted), strict=True)
        )
        cache.protected[missing] = True
        return len(missing)

    def preload(self, experts: np.ndarray, stats: PhaseStats) -> None:
        """Queue loads of ``experts`` (distinct, not resident) wanted by a later layer
        call, unprotected: the pool's victim order (predicted uses still to come,
        ``plec``) keeps them, and a copy not yet landed is retired like any other when
        its slot is taken. Counted as prefetched."""
        if len(experts):
            self._load_ahead(experts, self._take_slots(len(experts), experts, stats), stats)

    def admit(self, expert: int, stats: PhaseStats) -> bool:
        """Load ``expert`` in the background if the link is idle (it was just computed
        elsewhere and may be wanted again). Returns whether it was queued."""
        if self.cache.expert_slot[expert] >= 0 or not self.link.idle():
            return False
        return bool(self.prefetch(np.array([expert]), stats, admitted=True))

    def begin_run(self, experts: np.ndarray, stats: PhaseStats) -> None:
        """A call of the layer starts and will need ``experts`` (distinct ids). Protected
        prefetches are released: those among ``experts`` count as used; the others are
        dropped from the link if they have not started (no link time spent, their slots
        are free again) or else count as unused."""
        if not self.prefetches:
            return
        wanted = np.zeros(self.cache.num_experts, dtype=bool)
        wanted[experts] = True
        for expert, transfer in self.prefetches.items():
            if wanted[expert]:
                stats.prefetch_used += 1
            elif self.link.cancel(transfer):
                self.in_flight.pop(int(self.cache.expert_slot[expert]), None)
                self.cache.release(np.array([expert]))
                stats.prefetch_cancelled += 1
            else:
                stats.prefetch_unused += 1
        self.prefetches.clear()
        self.cache.protected[:] = False

    def evict(self, experts: np.ndarray, stats: PhaseStats) -> np.ndarray:
        """Evict those of ``experts`` that are resident and neither pinned nor protected;
        returns them."""
        cache = self.cache
        victims = np.intersect1d(experts, cache.evictable(np.zeros(0, dtype=np.int64)))
        if len(victims):
            self._retire(cache.release(victims))
            stats.evictions += len(victims)
        return victims

    def kernel_launched(self, experts: np.ndarray) -> None:
        """A kernel reading the slots of ``experts`` was just queued (CUDA: later copies
        into those slots are ordered after it)."""
        pool = self.cache.pool
        if pool.last_read is not None:
            event = torch.cuda.Event()
            event.record()
            pool.last_read[self.cache.expert_slot[experts]] = event

    def wait_all(self) -> None:
        """Block until every copy in flight has landed (before the pool is rebuilt; the
        link counts the stall, the counters restart anyway)."""
        for transfer in {id(t): t for t in self.in_flight.values()}.values():
            self.link.wait(transfer)
        self.in_flight.clear()

    # ----------------------------------------------------------------- internals

    def _take_slots(
        self, count: int, keep: np.ndarray, stats: PhaseStats, demand: np.ndarray | None = None
    ) -> np.ndarray:
        slots, evicted = self.cache.take_slots(count, keep, demand)
        stats.evictions += len(evicted)
        self._retire(slots)
        return slots

    def _retire(self, slots: np.ndarray) -> None:
        """``slots`` are about to be reused: an unused copy may still be moving there."""
        for slot in slots.tolist():
            old = self.in_flight.pop(slot, None)
            if old is not None:
                self.link.retire(old)

    def _load(
        self,
        experts: np.ndarray,
        slots: np.ndarray,
        stats: PhaseStats,
        prefetch: bool,
        admitted: bool = False,
    ) -> Transfer:
        """Copy ``experts`` into ``slots`` (free), one transfer."""
        self.cache.assign(experts, slots)
        count = len(experts)

        def started(transfer: Transfer) -> None:
            stats.loads += count
            stats.bytes_loaded += transfer.nbytes
            if prefetch:
                stats.prefetched += count
                stats.bytes_prefetched += transfer.nbytes
                stats.admitted += count if admitted else 0

        after: tuple[object, ...] = ()
        pool = self.cache.pool
        if pool.last_write is not None and pool.last_read is not None:  # (CUDA: both)
            after = tuple(
                {
                    id(e): e
                    for e in (*pool.last_write[slots], *pool.last_read[slots])
                    if e is not None
                }.values()
            )
        transfer = self.link.submit(
            self.cache.copy_of(experts), prefetch=prefetch, on_start=started, after=after
        )
        if pool.last_write is not None:
            pool.last_write[slots] = transfer
        for slot in slots.tolist():
            self.in_flight[slot] = transfer
        return transfer

    def _load_ahead(
        self, experts: np.ndarray, slots: np.ndarray, stats: PhaseStats, admitted: bool = False
    ) -> list[Transfer]:
        """Queue a load of ``experts`` into ``slots`` ahead of use; returns each
        expert's transfer. Where the link can cancel a queued transfer, one per expert:
        retiring one expert's slot must not cancel the others' copies."""
        if self.link.cancellable:
            return [
                self._load(
                    experts[i : i + 1], slots[i : i + 1], stats, prefetch=True, admitted=admitted
                )
                for i in range(len(experts))
            ]
        return [self._load(experts, slots, stats, prefetch=True, admitted=admitted)] * len(experts)

    def _wait_for(self, experts: np.ndarray, stats: PhaseStats) -> None:
        """Block until the slots of ``experts`` hold their data (no-op when nothing
        is in flight, the common case)."""
        if not self.in_flight:
            return
        transfers: dict[int, tuple[Transfer, list[int]]] = {}
        for slot in self.cache.expert_slot[experts].tolist():
            transfer = self.in_flight.pop(slot, None)
            if transfer is not None:
                transfers.setdefault(id(transfer), (transfer, []))[1].append(slot)
        failure: BaseException | None = None
        for transfer, slots in transfers.values():
            try:
                stats.stall_s += self.link.wait(transfer)
            except Exception as error:  # noqa: BLE001 - any failed copy, raised below
                # A failed copy (a disk read error, a corrupt record): its slots hold no
                # expert, so that no later call runs what it left there. The others are
                # still waited for: their slots are not in flight any more.
                self.cache.release(self.cache.slot_expert[slots])
                failure = failure or error
        if failure is not None:
            raise failure
