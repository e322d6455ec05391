"""ExpertCache: which of one MoE layer's routed experts sit in its device slots.

Residency and eviction only: a pool of exactly ``num_slots`` expert-sized slots per weight
tensor, allocated once (so the cache can never hold more than its budget), the
id <-> slot maps, the eviction policy, and the experts protected from eviction. Moving
bytes into slots, and the copies still in flight, belong to
:class:`~vllm_specexpert.loader.ExpertLoader`.

Kernels run experts from slots: :meth:`ExpertCache.slot_ids` turns router expert ids into
slot indices, and ``cache.slots`` stand in for the layer's weights.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_specexpert.store import LayerExperts


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
        self.policy = EVICTION_POLICIES[policy](num_experts, num_slots, top_k)
        # Slots never held by a pinned expert: any batch of this many experts fits.
        self._rotating_slots = num_slots - int(self.policy.pinned.sum())
        self.clock = 0

        self.slots: dict[str, torch.Tensor] = {
            key: torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype, device=device)
            for key, t in experts.tensors.items()
        }
        self.slot_expert = np.full(num_slots, -1, dtype=np.int64)
        """Slot -> the expert it holds, -1 when free."""
        self.expert_slot = np.full(num_experts, -1, dtype=np.int32)
        """Expert -> its slot, -1 when not resident (the id -> slot map)."""
        self.protected = np.zeros(num_experts, dtype=bool)
        """Prefetched experts whose layer has not run since: never evicted (the paper's
        ring of buffers: a prefetch is not overwritten before the layer that wanted it
        runs)."""
        # id -> slot map read by kernels. On CPU it shares memory with expert_slot; on
        # CUDA it is a device copy refreshed after every residency change.
        self._host_map = torch.from_numpy(self.expert_slot)
        self.slot_of = self._host_map if device.type == "cpu" else self._host_map.to(device)

        # Warm start: the first experts (the pinned ones for `static`) fill every slot.
        initial = np.arange(num_slots)
        self.assign(initial, initial)
        for dst, src in self.copy_pairs(initial):
            dst.copy_(src)

    # ------------------------------------------------------------------ queries

    def resident_mask(self) -> np.ndarray:
        return self.expert_slot >= 0

    def num_resident(self) -> int:
        return int(np.count_nonzero(self.slot_expert >= 0))

    def capacity_for(self, experts: np.ndarray) -> bool:
        """Whether all of ``experts`` (distinct ids) fit in the pool at once."""
        if len(experts) <= self._rotating_slots:
            return True
        pinned_resident = self.policy.pinned & self.resident_mask()
        outside = np.count_nonzero(~pinned_resident[experts])
        return outside <= self.num_slots - int(pinned_resident.sum())

    def evictable(self, keep: np.ndarray) -> np.ndarray:
        """Resident experts that may be evicted now, other than ``keep``."""
        evictable = self.resident_mask() & ~self.policy.pinned & ~self.protected
        evictable[keep] = False
        return np.flatnonzero(evictable)

    def slot_ids(self, topk_ids: torch.Tensor, host_ids: np.ndarray) -> torch.Tensor:
        """Router expert ids -> slot indices, same shape and dtype as ``topk_ids``.
        ``host_ids`` is the same ids on the host: on CPU the map is applied there (one
        numpy gather instead of three tensor ops on the decode path); on CUDA with a
        device gather, so that nothing waits for the host."""
        if self.device.type == "cpu":
            slots = torch.from_numpy(self.expert_slot[host_ids])
            return slots if slots.dtype == topk_ids.dtype else slots.to(topk_ids.dtype)
        flat = torch.index_select(self.slot_of, 0, topk_ids.reshape(-1))
        return flat.view(topk_ids.shape).to(topk_ids.dtype)

    def copy_pairs(self, experts: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(slot view, slow-tier view)`` per tensor of each of ``experts`` (resident)."""
        return [
            (self.slots[key][int(slot)], src[int(expert)])
            for expert, slot in zip(experts, self.expert_slot[experts])
            for key, src in self.experts.tensors.items()
        ]

    # ---------------------------------------------------------------- changes

    def take_slots(
        self, count: int, keep: np.ndarray, demand: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Free ``count`` slots for new experts and return ``(slots, evicted experts)``.
        Free slots go first; then the slots of evicted experts, never ``keep``, pinned
        or protected ones, the least needed by ``demand`` (per-expert count of later
        uses, if known) first, then in the policy's order."""
        free = np.flatnonzero(self.slot_expert < 0)
        if len(free) >= count:
            return free[:count], free[:0]
        candidates = self.policy.order(self.evictable(keep))
        if demand is not None:
            # Stable sort keeps the policy order among equal demand.
            candidates = candidates[np.argsort(demand[candidates], kind="stable")]
        need = count - len(free)
        if len(candidates) < need:
            raise RuntimeError(
                f"{self.experts.name}: cannot free {need} slots (capacity check skipped?)"
            )
        victims = candidates[:need]
        return np.concatenate([free, self.release(victims)]), victims

    def assign(self, experts: np.ndarray, slots: np.ndarray) -> None:
        """Record that ``slots`` (free) now hold ``experts`` (not resident)."""
        self.slot_expert[slots] = experts
        self.expert_slot[experts] = slots
        self._sync_device_map()

    def release(self, experts: np.ndarray) -> np.ndarray:
        """Forget resident ``experts``; returns the slots they held, now free."""
        slots = self.expert_slot[experts].astype(np.int64)
        self.expert_slot[experts] = -1
        self.slot_expert[slots] = -1
        self.protected[experts] = False
        self._sync_device_map()
        return slots

    def touch(self, experts: np.ndarray) -> None:
        """``experts`` are used by a kernel call now (eviction order)."""
        self.clock += 1
        self.policy.on_use(experts, self.clock)

    def _sync_device_map(self) -> None:
        if self.slot_of is not self._host_map:
            self.slot_of.copy_(self._host_map, non_blocking=True)
