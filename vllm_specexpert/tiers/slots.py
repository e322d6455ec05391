"""Slot pools: the expert cache's device memory, expert-sized slots allocated once at the
budget (no cache can hold more), and per-slot state: owner cache, the copy nobody has
waited for yet, and on CUDA the events ordering a new copy after the slot's last copy
and reader.

* :class:`LayerSlotPool`: one layer's own slots (``lru``, ``lfu``, ``static``), victims
  in its eviction policy's order.
* :class:`SharedSlotPool`: several layers' slots in one pool (``plec``, ExpertFlow
  §3.4); a load's victim may belong to another layer, chosen by predicted uses to come.
  :class:`SharedPools` puts consecutive layers in one until the next would take it past
  what the expert kernel addresses.
"""

from __future__ import annotations

import math
from typing import ClassVar, Protocol

import numpy as np
import torch

from vllm_specexpert.tiers.disk_reader import aligned_empty
from vllm_specexpert.tiers.eviction import EvictionPolicy
from vllm_specexpert.tiers.link import Transfer
from vllm_specexpert.tiers.shared_region import SharedRegion
from vllm_specexpert.tiers.store import ExpertSource

NO_EXPERTS = np.zeros(0, dtype=np.int64)


class PooledCache(Protocol):
    """What a pool uses of an :class:`~vllm_specexpert.tiers.cache.ExpertCache` (which
    imports this module)."""

    experts: ExpertSource
    num_experts: int
    num_slots: int
    top_k: int
    index: int
    rotating_slots: int
    policy: EvictionPolicy
    expert_slot: np.ndarray

    pool: SlotPool

    def resident_mask(self) -> np.ndarray: ...
    def evictable(self, keep: np.ndarray) -> np.ndarray: ...
    def evictable_mask(self) -> np.ndarray: ...
    def warm_start(self, offset: int, count: int) -> None: ...
    def release(self, experts: np.ndarray) -> np.ndarray: ...


class RegionRows:
    """Which layer's expert each row of a shared region holds
    (:mod:`~vllm_specexpert.tiers.shared_region`): its rows are slots that any layer's
    call may load into (demand loads, and reads ahead that the next call settles; not a
    prefetch, which stays in flight past its call: in a row another layer takes it would
    land on that layer's expert), by one clock for every layer on the region
    (:meth:`LayerSlotPool.take`)."""

    def __init__(self, region: SharedRegion) -> None:
        self.region = region
        self.holder: list[PooledCache | None] = [None] * region.rows
        self.clock = 0


class SlotPool:
    """Expert-sized device slots of one or more MoE layers' caches. Caches :meth:`join`
    with a share; :meth:`allocate` (by the cache for its own pool, by the engine for a
    shared one) makes the tensors and warm-starts each cache in its share."""

    shared: ClassVar[bool] = False
    rows: RegionRows | None = None
    """Who holds each row of its shared region (:class:`LayerSlotPool`'s; ``None``: none)."""
    readable_as_is: ClassVar[bool] = True
    """The kernel may read a slot as it is; ``False``: :meth:`readable` first."""

    def __init__(self, device: torch.device, region: SharedRegion | None = None) -> None:
        self.device = device
        self.region = region
        """Rows every layer's tensors cover after the pool's own slots (a call's streamed
        experts, :mod:`.shared_region`); ``None``: the own slots only."""
        self.region_rows = region.rows if region is not None else 0
        """Rows of a shared region after the own slots (0: none)."""
        self.caches: list[PooledCache] = []
        self._shares: list[int] = []
        self.joined_slots = 0
        """Slots its caches joined with: its size once allocated (without a region's rows)."""
        self.tensors: dict[str, torch.Tensor] = {}
        """Weight name -> ``[num_slots, ...]`` slot tensor (what kernels run on)."""
        self.owner = np.zeros(0, dtype=np.int32)
        """Slot -> index in :attr:`caches` of the cache holding it, -1 when free."""
        self.in_flight: dict[int, Transfer] = {}
        self.last_write: np.ndarray | None = None
        """CUDA: slot -> the last transfer into it (a new copy is ordered after it)."""
        self.last_read: np.ndarray | None = None
        """CUDA: slot -> event after the last kernel that read it."""
        self.clock = 0
        """Kernel calls so far: every cache's recency clock (comparable across layers)."""

    @property
    def num_slots(self) -> int:
        return len(self.owner)

    def tick(self) -> int:
        """A kernel call: the recency clock, one step on."""
        self.clock += 1
        return self.clock

    def claim(self, slots: np.ndarray, index: int) -> None:
        """``slots`` (free) hold experts of cache ``index`` now."""
        self.owner[slots] = index

    def free(self, slots: np.ndarray) -> None:
        self.owner[slots] = -1

    def take(
        self,
        cache: PooledCache,
        count: int,
        keep: np.ndarray,
        demand: np.ndarray | None = None,
        shared: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, evicted experts)``: ``count`` slots for ``cache``, free ones first,
        then those of :meth:`victims` (in a shared pool, maybe other layers').
        ``shared``: a demand load, which may take a shared region's rows
        (:class:`LayerSlotPool`)."""
        free = self._free_for(shared)
        if len(free) >= count:
            return free[:count], free[:0]
        holders, owners, candidates = self._candidates(cache, keep, demand, shared)
        need = count - len(free)
        if len(candidates) < need:
            raise RuntimeError(
                f"{cache.experts.name}: cannot free {need} slots (capacity check skipped?)"
            )
        owners, victims = owners[:need], candidates[:need]
        taken = [free]
        for index in np.unique(owners).tolist():
            holder = holders[index]
            slots = holder.release(victims[owners == index])
            if holder.pool is not self:  # (another layer's rows of a region, as this pool's)
                slots = slots - holder.pool.joined_slots + self.joined_slots
            taken.append(slots)
        return np.concatenate(taken), victims

    def _free_for(self, shared: bool) -> np.ndarray:
        """The free slots a load may take (``shared``: a demand load)."""
        return self.free_slots()

    def _candidates(
        self, cache: PooledCache, keep: np.ndarray, demand: np.ndarray | None, shared: bool
    ) -> tuple[list[PooledCache], np.ndarray, np.ndarray]:
        """``(holders, owner, experts)``: what a load of ``cache`` may evict, first to go
        first, each one's holder ``holders[owner]`` (:meth:`victims` here)."""
        owners, candidates = self.victims(cache, keep, demand)
        return self.caches, owners, candidates

    def join(self, cache: PooledCache, share: int) -> int:
        """Add ``cache`` with ``share`` warm-start slots; returns its index."""
        if self.caches:
            first = self.caches[0].experts
            if first.slot_shapes != cache.experts.slot_shapes:
                raise ValueError(
                    f"{cache.experts.name}: experts shaped unlike those of "
                    f"{first.name} cannot share a slot pool"
                )
        self.caches.append(cache)
        self._shares.append(share)
        self.joined_slots += share
        return len(self.caches) - 1

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A slot tensor: on the host page-aligned, so that the disk's reads land in it."""
        if self.device.type == "cpu":
            return aligned_empty(shape, dtype)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def allocate(self) -> None:
        total = self.joined_slots
        shapes = self.caches[0].experts.slot_shapes
        if self.region is not None:
            self.tensors = self.region.views(total)
            total += self.region.rows
        else:
            self.tensors = {
                key: self._empty((total, *shape), dtype) for key, (shape, dtype) in shapes.items()
            }
        self.owner = np.full(total, -1, dtype=np.int32)
        self.in_flight.clear()
        if self.device.type == "cuda":
            self.last_write = np.full(total, None, dtype=object)
            self.last_read = np.full(total, None, dtype=object)
        offset = 0
        for cache, share in zip(self.caches, self._shares, strict=True):
            cache.warm_start(offset, share)
            offset += share

    def release(self) -> None:
        """Drop the slot tensors now: the pool and its caches form a reference cycle,
        which would keep them until the next GC pass, two pools at once in a rebuild."""
        self.tensors = {}
        self.in_flight.clear()
        self.last_write = self.last_read = None

    def free_slots(self) -> np.ndarray:
        """Own slots free (a shared region's rows: :meth:`LayerSlotPool.take`)."""
        return np.flatnonzero(self.owner[: self.joined_slots] < 0)

    def readable(self, slots: torch.Tensor) -> tuple[int, int]:
        """Before a launch reads ``slots`` (the kernel's slot ids): make what they hold
        readable (here it is; a mapped pack's pages are read in). Returns the experts
        and bytes that had to be read for it."""
        return 0, 0

    def confirm(self, slots: torch.Tensor) -> None:
        """After a launch read ``slots``: raise
        :class:`~vllm_specexpert.tiers.store.ExpertsUnreadable` if what they held may have
        changed while it ran (here nothing can; a mapped pack's file opened for writing)."""

    def read_ahead(self, slots: np.ndarray) -> tuple[int, int]:
        """A prefetch of experts the pool holds (``slots``): start making them readable
        without waiting (here they are; a mapped pack's pages are read ahead). Returns
        the experts and bytes asked for."""
        return 0, 0

    def unreadable(self, slots: np.ndarray) -> np.ndarray:
        """``bool [len(slots)]``: which of the held ``slots`` a launch would have to read
        first (none here; a mapped pack's pages not in the page cache)."""
        return np.zeros(len(slots), dtype=bool)

    def victims(
        self, requester: PooledCache, keep: np.ndarray, demand: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(cache indices, experts)`` evictable now for ``requester``, first to go
        first; never ``keep``, pinned or protected experts. ``demand``: the requester's
        per-expert later uses in the same call (those go last)."""
        raise NotImplementedError

    def capacity_for(self, cache: PooledCache, experts: np.ndarray) -> bool:
        """Whether all of ``experts`` (distinct ids of ``cache``) fit at once."""
        raise NotImplementedError

    def capacity(self, cache: PooledCache) -> int:
        """How many distinct experts of ``cache`` can be resident at once now."""
        raise NotImplementedError

    def available_for(self, cache: PooledCache, keep: np.ndarray) -> int:
        """Slots ``cache`` could fill now without evicting ``keep`` (free or victims)."""
        return len(self.free_slots()) + len(self.victims(cache, keep)[1])

    def prefetch_room(self, cache: PooledCache, keep: np.ndarray) -> int:
        """How many experts of ``cache`` a prefetch may load now without evicting ``keep``."""
        return self.available_for(cache, keep)

    def room(self, cache: PooledCache, keep: np.ndarray) -> int:
        """How many experts of ``cache`` a demand load could bring now without evicting
        ``keep`` (:meth:`take` with ``shared``)."""
        free = len(self._free_for(shared=True))
        return free + len(self._candidates(cache, keep, None, shared=True)[2])


class LayerSlotPool(SlotPool):
    """One layer's own pool: its eviction policy's order, the least demanded first. With
    :class:`RegionRows`, its tensors cover a shared region's rows after its own slots,
    which its demand loads take as every layer's do (:meth:`take`)."""

    def __init__(self, device: torch.device, rows: RegionRows | None = None) -> None:
        super().__init__(device, rows.region if rows is not None else None)
        self.rows = rows

    def tick(self) -> int:
        if self.rows is None:
            return super().tick()
        self.rows.clock += 1  # (one clock: recency compares across the region's layers)
        return self.rows.clock

    def claim(self, slots: np.ndarray, index: int) -> None:
        super().claim(slots, index)
        if self.rows is not None:
            for row in (slots[slots >= self.joined_slots] - self.joined_slots).tolist():
                self.rows.holder[row] = self.caches[index]

    def free(self, slots: np.ndarray) -> None:
        super().free(slots)
        if self.rows is not None:
            for row in (slots[slots >= self.joined_slots] - self.joined_slots).tolist():
                self.rows.holder[row] = None

    def _free_for(self, shared: bool) -> np.ndarray:
        """With a region and ``shared`` (a demand load): free own slots, then free rows."""
        if self.rows is None or not shared:
            return self.free_slots()
        return np.concatenate([self.free_slots(), self._free_rows()])

    def _candidates(
        self, cache: PooledCache, keep: np.ndarray, demand: np.ndarray | None, shared: bool
    ) -> tuple[list[PooledCache], np.ndarray, np.ndarray]:
        """With a region and ``shared``: the cache's own victims and the rows other layers
        hold (:meth:`_shared_victims`); else its own slots' (:meth:`victims`)."""
        if self.rows is None or not shared:
            return super()._candidates(cache, keep, demand, shared)
        return self._shared_victims(cache, keep, demand)

    def _shared_victims(
        self, cache: PooledCache, keep: np.ndarray, demand: np.ndarray | None
    ) -> tuple[list[PooledCache], np.ndarray, np.ndarray]:
        """``(holders, owner, experts)``: the experts a demand load of ``cache`` may evict,
        first to go first, and each one's holder (``holders[owner]``). They are the
        cache's own evictable experts and the rows other layers hold (none in use, none
        still being read for its layer): the least demanded of the call's first; then
        the longest unused, counted from its layer's last call (the requester's: this
        one; its own experts take those times in its cache policy's order); then, among
        equals, the layer whose next call comes last (the requester's own, a step away,
        then the layer that ran just before it: Belady's rule on the cyclic layer
        order). Recency on one clock would evict the rows of the layer that
        ran longest ago, the next to run, whose call then evicts the one after it
        (``tests/test_shared_region.py``'s sweep counts the hits either order gives). By
        masks and arrays: this runs at every miss of a batch of one."""
        assert self.rows is not None
        holders = [cache]
        holders += {id(h): h for h in self.rows.holder if h is not None and h is not cache}.values()
        experts, owner, idle, turn, wanted = [], [], [], [], []
        for index, holder in enumerate(holders):
            if holder is cache:
                held = cache.policy.order(cache.evictable(keep))  # (its first to go first)
            else:
                in_rows = holder.expert_slot >= holder.pool.joined_slots
                held = np.flatnonzero(in_rows & holder.evictable_mask())
                in_flight = holder.pool.in_flight
                if in_flight:
                    slots = holder.expert_slot[held].tolist()
                    held = held[[slot not in in_flight for slot in slots]]
            used = holder.policy.last_used
            # The requester's last call is this one (what it does not need now, it
            # skipped now); another layer's, its latest uses. The requester's next call
            # is then the furthest; then that of whoever ran last.
            last_call = self.rows.clock + 1 if holder is cache else int(used.max())
            unused = last_call - used[held]
            if holder is cache:
                # The requester's own go in its cache policy's order (``lfu``, ``lrfu``:
                # the least used first), at the idle times its experts have, longest
                # first: as many of its own go before other layers' rows as by recency,
                # and under LRU, whose order that is, nothing changes.
                unused = np.sort(unused)[::-1]
            experts.append(held)
            owner.append(np.full(len(held), index))
            idle.append(unused)
            turn.append(np.full(len(held), last_call))
            wanted.append(
                demand[held] if demand is not None and holder is cache else np.zeros(len(held))
            )
        order = np.lexsort((-np.concatenate(turn), -np.concatenate(idle), np.concatenate(wanted)))
        return holders, np.concatenate(owner)[order], np.concatenate(experts)[order]

    def _free_rows(self) -> np.ndarray:
        assert self.rows is not None
        free = [row for row, holder in enumerate(self.rows.holder) if holder is None]
        return np.asarray(free, dtype=np.int64) + self.joined_slots

    def victims(
        self, requester: PooledCache, keep: np.ndarray, demand: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Its own slots' (a region's rows go by :meth:`take` to demand loads only)."""
        candidates = requester.policy.order(requester.evictable(keep))
        if self.rows is not None:
            candidates = candidates[requester.expert_slot[candidates] < self.joined_slots]
        if demand is not None:
            # Stable sort keeps the policy order among equal demand.
            candidates = candidates[np.argsort(demand[candidates], kind="stable")]
        return np.full(len(candidates), requester.index, dtype=np.int32), candidates

    def capacity_for(self, cache: PooledCache, experts: np.ndarray) -> bool:
        if len(experts) <= cache.rotating_slots:
            return True
        pinned_resident = cache.policy.pinned & cache.resident_mask()
        outside = np.count_nonzero(~pinned_resident[experts])
        return bool(outside <= self.capacity(cache))

    def capacity(self, cache: PooledCache) -> int:
        """Its own slots not pinned, and the rows of a region a demand load may take now:
        what other layers hold there is a demand load's to take (no layer but the running
        one needs it now), but for an expert still being read for its layer (a read
        ahead) or in use (:meth:`_shared_victims` passes both over)."""
        pinned = int(np.count_nonzero(cache.policy.pinned & cache.resident_mask()))
        if self.rows is None:
            return cache.num_slots - pinned + self.region_rows
        held = 0
        for holder in {
            id(h): h for h in self.rows.holder if h is not None and h is not cache
        }.values():
            in_rows = np.flatnonzero(holder.expert_slot >= holder.pool.joined_slots)
            kept = ~holder.evictable_mask()[in_rows]
            in_flight = holder.pool.in_flight
            if in_flight:
                slots = holder.expert_slot[in_rows].tolist()
                kept |= np.asarray([slot in in_flight for slot in slots], dtype=bool)
            held += int(np.count_nonzero(kept))
        return cache.num_slots - pinned + self.region_rows - held


class SharedSlotPool(SlotPool):
    """Every layer's slots in one pool (``plec``): victims by predicted uses to come."""

    shared = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.predicted_uses: np.ndarray = np.zeros((0, 0))
        """``[caches, experts]`` predicted uses still to come, kept by the PLEC planner;
        the fewest go first. Empty until :meth:`allocate`."""

    def allocate(self) -> None:
        super().allocate()
        self.predicted_uses = np.zeros((len(self.caches), self.caches[0].num_experts))

    def spare(self) -> int:
        """Slots free or holding evictable experts with no predicted use to come: what
        loads may take without evicting another prediction."""
        spare = len(self.free_slots())
        for cache in self.caches:
            candidates = cache.evictable(NO_EXPERTS)
            spare += int(np.count_nonzero(self.predicted_uses[cache.index][candidates] == 0))
        return spare

    def victims(
        self, requester: PooledCache, keep: np.ndarray, demand: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Every layer's evictable experts: no predicted use first, then the layer whose
        turn comes last (Belady on the cyclic layer order), fewest predicted uses, then
        the layer's own eviction order (``plec``'s: decayed uses, then recency)."""
        owners, experts, scores, turns, ranks = [], [], [], [], []
        layers = len(self.caches)
        for cache in self.caches:
            candidates = cache.policy.order(
                cache.evictable(keep if cache is requester else NO_EXPERTS)
            )
            score = self.predicted_uses[cache.index][candidates]
            if cache is requester and demand is not None:
                score = score + demand[candidates] * 1e9  # needed by this very call
            owners.append(np.full(len(candidates), cache.index, dtype=np.int32))
            experts.append(candidates)
            scores.append(score)
            # Layers run in pool order, one after another: the layer whose turn comes
            # last goes first (the requester's own, a whole step away: 0 here), Belady's
            # rule on the cyclic layer order. Recency alone would evict the layers that
            # ran longest ago, the next ones to run.
            turns.append(np.full(len(candidates), (requester.index - cache.index) % layers))
            ranks.append(np.arange(len(candidates)))  # (compared within a layer only)
        scores = np.concatenate(scores)
        order = np.lexsort((np.concatenate(ranks), scores, np.concatenate(turns), scores > 0))
        return np.concatenate(owners)[order], np.concatenate(experts)[order]

    def prefetch_room(self, cache: PooledCache, keep: np.ndarray) -> int:
        """Leaves ``top_k`` slots free or evictable: protected prefetches could otherwise
        fill every slot another layer's call needs."""
        reserve = max(c.top_k for c in self.caches)
        return max(self.available_for(cache, keep) - reserve, 0)

    def capacity_for(self, cache: PooledCache, experts: np.ndarray) -> bool:
        missing = np.count_nonzero(cache.expert_slot[experts] < 0)
        return bool(missing <= self.available_for(cache, experts))

    def capacity(self, cache: PooledCache) -> int:
        resident = np.flatnonzero(cache.resident_mask())
        return len(resident) + self.available_for(cache, resident)


class SharedPools:
    """``plec``'s pools: consecutive layers share one until the next layer's slots would
    make its tensors larger than the expert kernel addresses (the layers' ``reach``,
    elements per tensor), then a new one starts; one pool for all where the kernel has
    no such limit. A layer past the reach alone is refused before (``budget``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pools: list[SharedSlotPool] = []

    def pool_for(self, experts: ExpertSource, slots: int, reach: int | None) -> SharedSlotPool:
        """The pool a layer of ``experts`` with ``slots`` is to join (the caller joins it)."""
        widest = max(math.prod(shape) for shape, _ in experts.slot_shapes.values())
        last = self.pools[-1] if self.pools else None
        if last is None or (reach is not None and (last.joined_slots + slots) * widest > reach):
            self.pools.append(SharedSlotPool(self.device))
        return self.pools[-1]

    def allocate(self) -> None:
        """Make the tensors of every pool that has none (once every layer joined)."""
        for pool in self.pools:
            if not pool.tensors:
                pool.allocate()

    def release(self) -> None:
        for pool in self.pools:
            pool.release()
