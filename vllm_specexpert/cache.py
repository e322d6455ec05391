"""ExpertCache: which of one MoE layer's routed experts sit in its device slots.

Residency and eviction only: a pool of exactly ``num_slots`` expert-sized slots per weight
tensor, allocated once (so the cache can never hold more than its budget), the
id <-> slot maps, the eviction policy, and the experts protected from eviction. Moving
bytes into slots, and the copies still in flight, belong to
:class:`~vllm_specexpert.loader.ExpertLoader`.

Kernels run experts from slots: :meth:`ExpertCache.kernel_routing` gives what the kernel
needs to find an expert's slot, and ``cache.slots`` stand in for the layer's weights.

* CPU: the ids are turned into slot indices on the host (one numpy gather).
* CUDA (``device_map``): the router's ids reach the kernel unchanged, with the id -> slot
  map as the fused-MoE kernel's ``expert_map`` (-1: not resident, contributes zero). The
  map lives on the device. Residency changes mark entries dirty; the dirty entries are
  written by one :func:`~vllm_specexpert.triton_kernels.slots.update_slot_map` launch on
  the compute stream right before the next kernel of the layer, which the engine has
  ordered after the copies it uses. The compute stream is the map's only reader, so
  no host read of it is ever needed, and an expert evicted without a copy (a cancelled
  prefetch) is never referenced by a launch before its entry is reset.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_specexpert.staging import upload
from vllm_specexpert.store import LayerExperts
from vllm_specexpert.transfer import ExpertCopy


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
        device_map: bool | None = None,
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
        if device_map is None:
            device_map = device.type != "cpu"
        self.expert_map: torch.Tensor | None = (
            torch.full((num_experts,), -1, dtype=torch.int32, device=device)
            if device_map else None)
        """``int32 [E]`` id -> slot map on the device (``device_map``, see module doc);
        ``None`` where ids are mapped on the host."""
        self._map_dirty = np.zeros(num_experts, dtype=bool)
        """Experts whose ``expert_map`` entry is stale."""
        self.identity = num_slots == num_experts
        """Every expert resident in the slot of its own id: true from the warm start
        when the pool holds them all (nothing can miss, so nothing is ever loaded or
        evicted); an eviction ends it."""

        # Warm start: the first experts (the pinned ones for `static`) fill every slot.
        initial = np.arange(num_slots)
        self.assign(initial, initial)
        for key, src in experts.tensors.items():
            self.slots[key].copy_(src[:num_slots])

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

    def kernel_routing(
        self, topk_ids: torch.Tensor, host_ids: np.ndarray | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(ids, expert_map)`` for a kernel launch on the routing ``topk_ids`` (every
        expert resident; ``host_ids``: the same ids on the host, needed only without a
        device map or ``identity``). With a device map: the ids unchanged and the map,
        brought up to date on the current stream. Else the slot indices (same shape and
        dtype; the ids themselves under ``identity``) and ``None``."""
        if self.expert_map is not None:
            self.flush_map()
            return topk_ids, self.expert_map
        if self.identity:
            return topk_ids, None
        slots = torch.from_numpy(self.expert_slot[host_ids])
        return (slots if slots.dtype == topk_ids.dtype else slots.to(topk_ids.dtype)), None

    def flush_map(self) -> None:
        """Write the dirty entries of ``expert_map`` (one small upload and one launch;
        nothing when residency has not changed since the last launch)."""
        changed = np.flatnonzero(self._map_dirty)
        if not len(changed):
            return
        self._map_dirty[changed] = False
        update = upload(np.stack([changed, self.expert_slot[changed]]).astype(np.int32),
                        self.device)
        if self.device.type == "cuda":
            from vllm_specexpert.triton_kernels.slots import update_slot_map

            update_slot_map(self.expert_map, update[0], update[1])
        else:  # the device-map path exercised on the CPU (tests)
            self.expert_map[update[0].long()] = update[1]

    def copy_of(self, experts: np.ndarray) -> ExpertCopy:
        """The transfer that fills the slots of ``experts`` (resident) from the slow tier."""
        return ExpertCopy(self.experts.tensors, self.slots, experts,
                          self.expert_slot[experts].astype(np.int64))

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
        self._map_dirty[experts] = True

    def release(self, experts: np.ndarray) -> np.ndarray:
        """Forget resident ``experts``; returns the slots they held, now free."""
        slots = self.expert_slot[experts].astype(np.int64)
        self.expert_slot[experts] = -1
        self.slot_expert[slots] = -1
        self.protected[experts] = False
        self._map_dirty[experts] = True
        self.identity = False
        return slots

    def touch(self, experts: np.ndarray) -> None:
        """``experts`` are used by a kernel call now (eviction order)."""
        self.clock += 1
        self.policy.on_use(experts, self.clock)
