"""ExpertLoader: copies into one layer's slots over the link, and the copies in flight.

The only writer of slots after warm start. It takes slots from the cache's
:class:`SlotPool` (whose victims each holding cache releases), has the
:class:`ExpertCache` record what they hold, submits the copy to the :class:`Link` and
records in the pool which slot waits for which copy (in a shared pool, possibly another
layer's):

* using a slot whose copy has not landed waits for it (stall);
* reusing a slot first retires its copy (dropped if not started, else finished), so an
  old copy never lands on a new expert; on CUDA the new copy is instead ordered after
  the slot's previous copy and last reading kernel (per-slot events);
* prefetched experts are protected from eviction until the layer's next call
  (:meth:`begin_run`), which counts them as used, cancelled or unused.

Counters go to the phase ``stats`` each call is given; the link counts copies and bytes
when a copy starts (a dropped prefetch never counts as moved).
"""

from __future__ import annotations

import contextlib

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
        self.reads_ahead: dict[int, Transfer] = {}
        """Expert -> its read ahead of the next call (:meth:`read_ahead`), until that call."""
        self.last_needed: np.ndarray | None = None
        """The distinct experts of the layer's last call (what its next is expected to need)."""

    @property
    def in_flight(self) -> dict[int, Transfer]:
        """Pool slot -> its copy nobody has waited for yet (shared pool: other layers' too)."""
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
        self,
        experts: np.ndarray,
        stats: PhaseStats,
        future_demand: np.ndarray | None = None,
        tokens: int = 1,
        uses: np.ndarray | None = None,
    ) -> None:
        """Make ``experts`` (distinct ids that fit, :meth:`ExpertCache.capacity_for`)
        resident and landed for a launch of ``tokens`` tokens, and count the request.
        Victims are never among ``experts``; ``future_demand`` (per-expert later uses in
        the batch) keeps the most needed; ``uses`` (per expert, the launch's tokens on it)
        places the most used in the layer's own slots (:meth:`request`). A prefetch still
        in flight counts as a hit, waiting for it as stall."""
        self.request(experts, stats, experts, future_demand, uses=uses)
        self.land(experts, stats, tokens)

    def request(
        self,
        experts: np.ndarray,
        stats: PhaseStats,
        keep: np.ndarray,
        future_demand: np.ndarray | None = None,
        ahead: bool = False,
        uses: np.ndarray | None = None,
    ) -> None:
        """:meth:`acquire`'s first half: count the request and queue the loads of those
        of ``experts`` not resident, evicting none of ``keep`` (``experts`` and what the
        caller computes meanwhile); :meth:`land` waits for them. ``ahead``: the caller
        computes before it waits (the link moves them meanwhile). ``uses``: where the
        loads take the layer's own slots and a shared region's rows, the most used go to
        its own slots: the layers after it take the rows first, and a call that passed
        its own slots (a prompt) leaves them holding what it used most, not what came
        first in file order (at one sequence after a prompt, 12 % fewer loads in the
        first 15 decode steps of a replay, docs/limits.md)."""
        cache = self.cache
        missing = experts[cache.expert_slot[experts] < 0]
        stats.requests += len(experts)
        stats.misses += len(missing)
        stats.hits += len(experts) - len(missing)
        if len(missing):
            slots = self._take_slots(len(missing), keep, stats, demand=future_demand, shared=True)
            if uses is not None:
                own = slots < cache.pool.joined_slots
                slots = np.concatenate([slots[own], slots[~own]])
                missing = missing[np.argsort(-uses[missing], kind="stable")]
            self._load(missing, slots, stats, prefetch=False, ahead=ahead)

    def land(self, experts: np.ndarray, stats: PhaseStats, tokens: int = 1) -> None:
        """:meth:`acquire`'s second half: block until ``experts`` hold their data, used
        by a launch of ``tokens`` tokens."""
        self._wait_for(experts, stats)
        self.cache.touch(experts, tokens)

    def prefetch(
        self,
        experts: np.ndarray,
        stats: PhaseStats,
        admitted: bool = False,
        likelihood: np.ndarray | None = None,
    ) -> int:
        """Queue loads of ``experts`` (distinct, most wanted first) ahead of use, as many
        as :meth:`SlotPool.prefetch_room` allows; they stay protected until
        :meth:`begin_run`. ``likelihood``: per expert of the layer, the chance the call
        the prefetch is for uses it; then the least likely go first, and a prefetch never
        evicts an expert at least as likely as the one it brings (a wrong guess would
        cost a read the right one saves). Experts held but not readable (a mapped pack's
        pages) are read ahead instead. Returns how many loads were queued."""
        cache = self.cache
        slot = cache.expert_slot[experts]
        if not cache.pool.readable_as_is:  # (held, but maybe not readable: read ahead)
            read, nbytes = cache.pool.read_ahead(slot[slot >= 0])
            stats.loads += read
            stats.prefetched += read
            stats.bytes_loaded += nbytes
            stats.bytes_prefetched += nbytes
        missing = experts[slot < 0]
        if not len(missing):
            return 0
        missing = missing[: cache.pool.prefetch_room(cache, experts)]
        if likelihood is not None:
            missing = missing[: self._outranking(missing, experts, likelihood)]
        if not len(missing):
            return 0
        slots = self._take_slots(len(missing), experts, stats, demand=likelihood)
        self.prefetches.update(
            zip(missing.tolist(), self._load_ahead(missing, slots, stats, admitted), strict=True)
        )
        cache.protected[missing] = True
        return len(missing)

    def _outranking(self, missing: np.ndarray, keep: np.ndarray, likelihood: np.ndarray) -> int:
        """How many of ``missing`` (most likely first) take a free slot or evict an
        expert less likely than themselves: victims go least likely first (what
        :meth:`_take_slots` takes with this ``likelihood`` as demand); another layer's
        expert in a shared pool counts as unlikely here (its own order keeps it)."""
        cache = self.cache
        free = len(cache.pool.free_slots())
        if free >= len(missing):
            return len(missing)
        owners, victims = cache.pool.victims(cache, keep, likelihood)
        chance = np.where(owners == cache.index, likelihood[victims], 0.0)
        bringing = likelihood[missing[free:]]
        n = min(len(bringing), len(chance))
        worse = np.flatnonzero(chance[:n] >= bringing[:n])
        return free + (int(worse[0]) if len(worse) else n)

    def preload(self, experts: np.ndarray, stats: PhaseStats) -> None:
        """Queue loads of ``experts`` (distinct, not resident) for a later layer call,
        unprotected: the pool's victim order (``plec``) is what keeps them."""
        if len(experts):
            self._load_ahead(experts, self._take_slots(len(experts), experts, stats), stats)

    def read_ahead(self, experts: np.ndarray, stats: PhaseStats) -> int:
        """Queue reads of those of ``experts`` (distinct, in file order: what the layer's
        next call is expected to need) that are not resident, as many as fit the slots and
        shared rows its demand loads would take, none of ``experts`` and none in use (the
        running call's, another layer's). Unlike a prefetch they may take a shared
        region's rows: the next call waits for them, or, not needing them, its start
        does (:meth:`begin_run`), before any other layer's call could take their row.
        Returns how many reads were queued."""
        cache = self.cache
        missing = experts[cache.expert_slot[experts] < 0]
        missing = missing[: cache.pool.room(cache, experts)]
        if not len(missing):
            return 0
        slots = self._take_slots(len(missing), experts, stats, shared=True)
        transfer = self._load(missing, slots, stats, prefetch=False, ahead=True)
        self.reads_ahead.update(dict.fromkeys(missing.tolist(), transfer))
        stats.read_ahead += len(missing)
        return len(missing)

    def admit(self, expert: int, stats: PhaseStats) -> bool:
        """Load ``expert`` (just computed elsewhere) in the background if the link is idle."""
        if self.cache.expert_slot[expert] >= 0 or not self.link.idle():
            return False
        return bool(self.prefetch(np.array([expert]), stats, admitted=True))

    def begin_run(self, experts: np.ndarray, stats: PhaseStats) -> None:
        """A layer call needing ``experts`` starts: release the protected prefetches;
        those not needed are cancelled if not started (slots freed), else count as unused.
        Reads ahead it does not need are waited for (their rows are then any layer's)."""
        self.last_needed = experts
        if self.reads_ahead:
            self._settle_reads_ahead(experts, stats)
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

    def _settle_reads_ahead(self, experts: np.ndarray, stats: PhaseStats) -> None:
        """The call needing ``experts`` waits for those reads ahead (:meth:`land`); the
        others are waited for now, so that no row is in flight past its call."""
        unneeded = np.setdiff1d(np.fromiter(self.reads_ahead, dtype=np.int64), experts)
        self.reads_ahead.clear()
        stats.read_ahead_unused += len(unneeded)
        # A failed read of an expert this call does not use: _wait_for freed its slot,
        # and a call that needs it reads it again.
        with contextlib.suppress(Exception):
            self._wait_for(unneeded, stats)

    def evict(self, experts: np.ndarray, stats: PhaseStats) -> np.ndarray:
        """Evict (and return) those of ``experts`` resident and neither pinned nor protected."""
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
        """Block until every copy in flight has landed (before the pool is rebuilt)."""
        for transfer in {id(t): t for t in self.in_flight.values()}.values():
            self.link.wait(transfer)
        self.in_flight.clear()

    # ----------------------------------------------------------------- internals

    def _take_slots(
        self,
        count: int,
        keep: np.ndarray,
        stats: PhaseStats,
        demand: np.ndarray | None = None,
        shared: bool = False,
    ) -> np.ndarray:
        """``shared``: a demand load (waited for in its call), which may take a shared
        region's rows (a prefetch may not: :class:`~.slots.RegionRows`)."""
        cache = self.cache
        slots, evicted = cache.pool.take(cache, count, keep, demand, shared)
        stats.evictions += len(evicted)
        stats.region_loads += int(np.count_nonzero(slots >= cache.pool.joined_slots))
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
        ahead: bool = False,
    ) -> Transfer:
        copy = self.cache.assign(experts, slots)
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
            copy,
            prefetch=prefetch,
            on_start=started,
            after=after,
            ahead=ahead,
        )
        if pool.last_write is not None:
            pool.last_write[slots] = transfer
        for slot in slots.tolist():
            self.in_flight[slot] = transfer
        return transfer

    def _load_ahead(
        self, experts: np.ndarray, slots: np.ndarray, stats: PhaseStats, admitted: bool = False
    ) -> list[Transfer]:
        """Each expert's transfer: one per expert where the link can cancel a queued
        one (retiring one slot must not cancel the others' copies), else one for all."""
        if self.link.cancellable:
            return [
                self._load(
                    experts[i : i + 1], slots[i : i + 1], stats, prefetch=True, admitted=admitted
                )
                for i in range(len(experts))
            ]
        return [self._load(experts, slots, stats, prefetch=True, admitted=admitted)] * len(experts)

    def _wait_for(self, experts: np.ndarray, stats: PhaseStats) -> None:
        """Block until the slots of ``experts`` hold their data."""
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
