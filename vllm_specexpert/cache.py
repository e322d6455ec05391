"""The device expert cache of one MoE layer: a fixed pool of slots, an id -> slot map,
an eviction policy and the layer's counters.

Kernels run experts from slots: ``slot_ids = cache.slot_of[topk_ids]`` turns router
expert ids into slot indices, and the slot tensors stand in for the layer's weights.
The pool is allocated once with exactly ``num_slots`` experts per tensor, so the cache can
never hold more than its budget.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_specexpert.stats import LayerStats
from vllm_specexpert.store import LayerExperts
from vllm_specexpert.transfer import Link, Transfer


class EvictionPolicy:
    """Orders eviction candidates. Subclasses keep per-expert usage state."""

    name = "base"

    def __init__(self, num_experts: int, num_slots: int, top_k: int):
        self.last_used = np.zeros(num_experts, dtype=np.int64)
        self.pinned = np.zeros(num_experts, dtype=bool)
        """Experts that are never evicted once resident."""

    def on_use(self, experts: np.ndarray, clock: int) -> None:
        self.last_used[experts] = clock

    def order(self, candidates: np.ndarray) -> np.ndarray:
        """``candidates`` sorted so that the first is evicted first."""
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def order(self, candidates: np.ndarray) -> np.ndarray:
        return candidates[np.argsort(self.last_used[candidates], kind="stable")]


class LFUPolicy(EvictionPolicy):
    name = "lfu"

    def __init__(self, num_experts: int, num_slots: int, top_k: int):
        super().__init__(num_experts, num_slots, top_k)
        self.uses = np.zeros(num_experts, dtype=np.int64)

    def on_use(self, experts: np.ndarray, clock: int) -> None:
        super().on_use(experts, clock)
        self.uses[experts] += 1

    def order(self, candidates: np.ndarray) -> np.ndarray:
        # lexsort: last key is primary -> fewest uses first, then least recent.
        return candidates[np.lexsort((self.last_used[candidates], self.uses[candidates]))]


class StaticPolicy(LRUPolicy):
    """The first ``num_slots - top_k`` experts are pinned; ``top_k`` slots rotate (LRU)."""

    name = "static"

    def __init__(self, num_experts: int, num_slots: int, top_k: int):
        super().__init__(num_experts, num_slots, top_k)
        self.pinned[: max(num_slots - top_k, 0)] = True


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, LFUPolicy, StaticPolicy)
}


class ExpertCache:
    """Slot pool and residency of one MoE layer's routed experts."""

    def __init__(
        self,
        experts: LayerExperts,
        num_slots: int,
        top_k: int,
        policy: str,
        device: torch.device,
        link: Link,
    ):
        num_experts = experts.num_experts
        if not top_k <= num_slots <= num_experts:
            raise ValueError(
                f"{experts.name}: need top_k ({top_k}) <= slots ({num_slots}) <= "
                f"experts ({num_experts})"
            )
        self.experts = experts
        self.num_slots = num_slots
        self.num_experts = num_experts
        self.top_k = top_k
        self.device = device
        self.link = link
        self.policy = EVICTION_POLICIES[policy](num_experts, num_slots, top_k)
        # Slots never held by a pinned expert: any batch of this many experts fits.
        self._rotating_slots = num_slots - int(self.policy.pinned.sum())
        self.clock = 0

        self.slots: dict[str, torch.Tensor] = {
            key: torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype, device=device)
            for key, t in experts.tensors.items()
        }
        self.slot_expert = np.full(num_slots, -1, dtype=np.int64)
        self.expert_slot = np.full(num_experts, -1, dtype=np.int32)
        self.protected = np.zeros(num_experts, dtype=bool)
        """Prefetched experts whose layer has not run since: never evicted (the paper's
        ring of buffers: a prefetch is not overwritten before the layer that wanted it
        runs)."""
        self._protected_any = False
        """Whether ``protected`` has a True entry (cheaper than ``.any()`` per call)."""
        self._prefetches: dict[int, Transfer] = {}
        """Protected expert -> its prefetch transfer (cancellable until it starts)."""
        self._in_flight: dict[int, Transfer] = {}
        """slot -> transfer still copying into it (waited for on first use)."""
        # id -> slot map read by kernels. On CPU it shares memory with expert_slot; on
        # CUDA it is a device copy refreshed after every residency change.
        self._host_map = torch.from_numpy(self.expert_slot)
        self.slot_of = self._host_map if device.type == "cpu" else self._host_map.to(device)

        # Warm start: the first experts (the pinned ones for `static`) fill every slot.
        initial = np.arange(num_slots)
        self._assign(initial, np.arange(num_slots))
        self._copy_now(initial)
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = LayerStats(max_resident=self.num_resident())

    # ------------------------------------------------------------------ queries

    def resident_mask(self) -> np.ndarray:
        return self.expert_slot >= 0

    def ready_mask(self) -> np.ndarray:
        """Resident experts whose data is usable now: in-flight copies that have not
        landed yet are left out (a policy that can compute them elsewhere need not wait)."""
        mask = self.expert_slot >= 0
        for slot, transfer in self._in_flight.items():
            if not transfer.ready():
                mask[self.slot_expert[slot]] = False
        return mask

    def num_resident(self) -> int:
        return int((self.slot_expert >= 0).sum())

    def capacity_for(self, experts: np.ndarray) -> bool:
        """Whether all of ``experts`` (distinct ids) fit in the pool at once."""
        if len(experts) <= self._rotating_slots:
            return True
        pinned_resident = self.policy.pinned & self.resident_mask()
        outside = np.count_nonzero(~pinned_resident[experts])
        return outside <= self.num_slots - int(pinned_resident.sum())

    def slot_ids(self, topk_ids: torch.Tensor, host_ids: np.ndarray) -> torch.Tensor:
        """Router expert ids -> slot indices, same shape and dtype as ``topk_ids``.
        ``host_ids`` is the same ids on the host: on CPU the map is applied there (one
        numpy gather instead of three tensor ops on the decode path); on CUDA with a
        device gather, so that nothing waits for the host."""
        if self.device.type == "cpu":
            return torch.from_numpy(self.expert_slot[host_ids]).to(topk_ids.dtype)
        flat = torch.index_select(self.slot_of, 0, topk_ids.reshape(-1))
        return flat.view(topk_ids.shape).to(topk_ids.dtype)

    # ---------------------------------------------------------------- residency

    def begin_run(self, experts: np.ndarray) -> None:
        """A forward call of the layer starts and will need ``experts`` (distinct ids).
        Protected prefetches are released: those among ``experts`` count as used; the
        others are dropped from the link if they have not started (no link time spent,
        their slots are free again) or else count as unused."""
        if not self._protected_any:
            return
        self._protected_any = False
        wanted = np.zeros_like(self.protected)
        wanted[experts] = True
        for expert in np.flatnonzero(self.protected):
            transfer = self._prefetches.pop(int(expert))
            if wanted[expert]:
                self.stats.prefetch_used += 1
            elif self.link.cancel(transfer):
                self._forget(expert, transfer)
            else:
                self.stats.prefetch_unused += 1
        self._prefetches.clear()
        self.protected[:] = False

    def _forget(self, expert: int, transfer: Transfer) -> None:
        """Undo a cancelled prefetch: its slot is free and nothing moved."""
        slot = int(self.expert_slot[expert])
        self.expert_slot[expert] = -1
        self.slot_expert[slot] = -1
        self._in_flight.pop(slot, None)
        self.stats.prefetch_cancelled += 1
        self.stats.prefetched -= 1
        self.stats.loads -= 1
        self.stats.bytes_loaded -= transfer.nbytes
        self.stats.bytes_prefetched -= transfer.nbytes

    def acquire(
        self,
        experts: np.ndarray,
        future_demand: np.ndarray | None = None,
    ) -> None:
        """Make every expert of ``experts`` (distinct ids, which must fit, see
        :meth:`capacity_for`) resident and usable, loading the missing ones over the
        link, and count the request. Victims are never among ``experts``; they are the
        free slots first, then the experts least needed by ``future_demand`` (per-expert
        count of later uses in the same batch, if any), then the policy's order. Experts
        still in flight from a prefetch count as hits; waiting for them counts as
        stall."""
        self.clock += 1
        missing = experts[self.expert_slot[experts] < 0]
        stats = self.stats
        stats.requests += len(experts)
        stats.misses += len(missing)
        stats.hits += len(experts) - len(missing)
        if len(missing):
            slots = self._victim_slots(len(missing), protect=experts, demand=future_demand)
            self._start_load(missing, slots)
            stats.max_resident = max(stats.max_resident, self.num_resident())
        self._wait_for(experts)
        self.policy.on_use(experts, self.clock)

    def prefetch(self, experts: np.ndarray) -> int:
        """Queue loads of ``experts`` (distinct ids, most wanted first) ahead of use,
        one transfer each, in that order. Already resident ones are skipped; at most as
        many as there are evictable slots are loaded (the least wanted are dropped).
        Loaded experts are protected from eviction until the layer's next run starts
        (:meth:`begin_run`). Returns how many experts were queued."""
        missing = experts[self.expert_slot[experts] < 0]
        if not len(missing):
            return 0
        available = np.count_nonzero(self.slot_expert < 0) + len(self._evictable(experts))
        missing = missing[:available]
        if not len(missing):
            return 0
        slots = self._victim_slots(len(missing), protect=experts, demand=None)
        self._assign(missing, slots)
        for expert, slot in zip(missing.tolist(), slots.tolist()):
            transfer = self.link.submit(self._pairs([expert]), prefetch=True)
            self._in_flight[slot] = transfer
            self._prefetches[expert] = transfer
            self.stats.bytes_prefetched += transfer.nbytes
            self.stats.bytes_loaded += transfer.nbytes
        self.stats.loads += len(missing)
        self.protected[missing] = True
        self._protected_any = True
        self.stats.prefetched += len(missing)
        self.stats.max_resident = max(self.stats.max_resident, self.num_resident())
        return len(missing)

    def admit(self, expert: int) -> bool:
        """Load ``expert`` in the background if the link is idle (it was just computed
        elsewhere and may be wanted again). Returns whether it was queued."""
        if self.expert_slot[expert] >= 0 or not self.link.idle():
            return False
        queued = self.prefetch(np.array([expert]))
        self.stats.admitted += queued
        return bool(queued)

    def _evictable(self, protect: np.ndarray) -> np.ndarray:
        evictable = self.resident_mask() & ~self.policy.pinned & ~self.protected
        evictable[protect] = False
        return np.flatnonzero(evictable)

    def _victim_slots(
        self, count: int, protect: np.ndarray, demand: np.ndarray | None
    ) -> np.ndarray:
        free = np.flatnonzero(self.slot_expert < 0)
        if len(free) >= count:
            return free[:count]
        candidates = self.policy.order(self._evictable(protect))
        if demand is not None:
            # Stable sort keeps the policy order among equal demand.
            candidates = candidates[np.argsort(demand[candidates], kind="stable")]
        need = count - len(free)
        if len(candidates) < need:
            raise RuntimeError(
                f"{self.experts.name}: cannot free {need} slots (capacity check skipped?)"
            )
        victims = candidates[:need]
        self.stats.evictions += len(victims)
        slots = self.expert_slot[victims].astype(np.int64)
        for slot in slots.tolist():  # an unused prefetch may still be moving there
            old = self._in_flight.pop(slot, None)
            if old is not None:
                self.link.retire(old)
        self.expert_slot[victims] = -1
        self.slot_expert[slots] = -1
        return np.concatenate([free, slots])

    def _assign(self, experts: np.ndarray, slots: np.ndarray) -> None:
        self.slot_expert[slots] = experts
        self.expert_slot[experts] = slots
        if self.slot_of is not self._host_map:
            self.slot_of.copy_(self._host_map, non_blocking=True)

    def _pairs(self, experts: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (self.slots[key][int(slot)], src[int(expert)])
            for expert, slot in zip(experts, self.expert_slot[experts])
            for key, src in self.experts.tensors.items()
        ]

    def _start_load(self, experts: np.ndarray, slots: np.ndarray) -> Transfer:
        """Demand load of ``experts`` into ``slots``, one transfer."""
        self._assign(experts, slots)
        transfer = self.link.submit(self._pairs(experts))
        for slot in slots:
            self._in_flight[int(slot)] = transfer
        self.stats.loads += len(experts)
        self.stats.bytes_loaded += transfer.nbytes
        return transfer

    def _wait_for(self, experts: np.ndarray) -> None:
        """Block until the slots of ``experts`` hold their data (no-op when nothing
        is in flight, the common case)."""
        if not self._in_flight:
            return
        transfers = []
        for slot in self.expert_slot[experts]:
            transfer = self._in_flight.pop(int(slot), None)
            if transfer is not None and all(t is not transfer for t in transfers):
                transfers.append(transfer)
        for transfer in transfers:
            self.stats.stall_s += self.link.wait(transfer)

    def _copy_now(self, experts: np.ndarray) -> None:
        """Synchronous copy outside the link and the counters (warm start)."""
        for dst, src in self._pairs(experts):
            dst.copy_(src)
