"""ExpertCache: which of one MoE layer's routed experts sit in device slots.

Residency and eviction only: the id <-> slot maps, the eviction policy, and the experts
protected from eviction. Moving bytes into slots belongs to
:class:`~vllm_specexpert.tiers.loader.ExpertLoader`.

The slots themselves are a :class:`~vllm_specexpert.tiers.slots.SlotPool`, the layer's
own or one shared by every layer (``plec``); the pool's strategy chooses victims. The
order among a layer's own experts is its eviction policy's
(:mod:`vllm_specexpert.tiers.eviction`).

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

from vllm_specexpert.tiers.eviction import CACHE_CLASSES
from vllm_specexpert.tiers.link import ExpertCopy
from vllm_specexpert.tiers.slots import LayerSlotPool, SlotPool
from vllm_specexpert.tiers.staging import upload
from vllm_specexpert.tiers.store import ExpertSource


class ExpertCache:
    """Residency of one MoE layer's routed experts in a :class:`SlotPool`."""

    def __init__(
        self,
        experts: ExpertSource,
        num_slots: int,
        top_k: int,
        policy: str,
        device: torch.device,
        device_map: bool | None = None,
        pool: SlotPool | None = None,
    ):
        num_experts = experts.num_experts
        if not top_k <= num_slots <= num_experts:
            raise ValueError(
                f"{experts.name}: need top_k ({top_k}) <= slots ({num_slots}) <= "
                f"experts ({num_experts})"
            )
        self.experts = experts
        self.num_slots = num_slots
        """Slots of this layer: its own pool's size, or its share of a shared pool
        (what it holds at warm start; then it holds what its experts win)."""
        self.num_experts = num_experts
        self.top_k = top_k
        self.device = device
        self.policy = CACHE_CLASSES[policy](num_experts, num_slots, top_k)
        self.rotating_slots = num_slots - int(self.policy.pinned.sum())
        """Slots never held by a pinned expert: any batch of this many experts fits."""
        self.pool = pool if pool is not None else LayerSlotPool(device)
        self.index = self.pool.join(self, num_slots)
        """This cache's index in the pool (:attr:`SlotPool.owner`)."""
        self.slot_expert = np.zeros(0, dtype=np.int64)
        """Pool slot -> the expert of this layer it holds, -1 when it holds none."""
        self.expert_slot = np.full(num_experts, -1, dtype=np.int32)
        """Expert -> its pool slot, -1 when not resident (the id -> slot map)."""
        self.in_use = np.zeros(num_experts, dtype=bool)
        """Experts a kernel launch is about to read (between the call acquiring them and
        the launch, other layers' loads run: in a shared pool they must not take these)."""
        self.protected = np.zeros(num_experts, dtype=bool)
        """Prefetched experts whose layer has not run since: never evicted (the paper's
        ring of buffers: a prefetch is not overwritten before the layer that wanted it
        runs)."""
        if device_map is None:
            device_map = device.type != "cpu"
        self.expert_map: torch.Tensor | None = (
            torch.full((num_experts,), -1, dtype=torch.int32, device=device) if device_map else None
        )
        """``int32 [E]`` id -> slot map on the device (``device_map``, see module doc);
        ``None`` where ids are mapped on the host."""
        self._map_dirty = np.zeros(num_experts, dtype=bool)
        """Experts whose ``expert_map`` entry is stale."""
        self.identity = False
        """Every expert resident in the slot of its own id: true from the warm start
        when a layer's own pool holds them all (nothing can miss, so nothing is ever
        loaded or evicted); an eviction ends it."""
        if pool is None:
            self.pool.allocate()

    def warm_start(self, offset: int, count: int) -> None:
        """The pool is allocated: the first ``count`` experts (the pinned ones for
        ``static``) fill slots ``offset ..`` of it."""
        self.slot_expert = np.full(self.pool.num_slots, -1, dtype=np.int64)
        self.assign(np.arange(count), np.arange(offset, offset + count))
        # Through the source's own copy: the disk's read window, as a miss (staging_nbytes).
        device = self.device if self.device.type != "cpu" else None
        self.experts.copy_into(
            np.arange(count), np.arange(offset, offset + count), self.slots, device
        )
        self.identity = count == self.num_experts and not self.pool.shared

    @property
    def slots(self) -> dict[str, torch.Tensor]:
        """Weight name -> the pool's slot tensor (kernels index it by slot)."""
        return self.pool.tensors

    # ------------------------------------------------------------------ queries

    def resident_mask(self) -> np.ndarray:
        return self.expert_slot >= 0

    def num_resident(self) -> int:
        return int(np.count_nonzero(self.slot_expert >= 0))

    def capacity_for(self, experts: np.ndarray) -> bool:
        """Whether all of ``experts`` (distinct ids) fit in the pool at once."""
        return self.pool.capacity_for(self, experts)

    def capacity(self) -> int:
        """How many distinct experts of this layer can be resident at once now, counting
        only those that need a slot that pinned experts do not hold."""
        return self.pool.capacity(self)

    def evictable(self, keep: np.ndarray) -> np.ndarray:
        """Resident experts that may be evicted now, other than ``keep``."""
        evictable = self.resident_mask() & ~self.policy.pinned & ~self.protected & ~self.in_use
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
        expert_map = self.expert_map
        if not len(changed) or expert_map is None:
            return
        self._map_dirty[changed] = False
        update = upload(
            np.stack([changed, self.expert_slot[changed]]).astype(np.int32), self.device
        )
        if self.device.type == "cuda":
            from vllm_specexpert.triton_kernels.slots import update_slot_map

            update_slot_map(expert_map, update[0], update[1])
        else:  # the device-map path exercised on the CPU (tests)
            expert_map[update[0].long()] = update[1]

    def copy_of(self, experts: np.ndarray) -> ExpertCopy:
        """The transfer that fills the slots of ``experts`` (resident) from the slow tier."""
        return ExpertCopy(
            self.experts, self.slots, experts, self.expert_slot[experts].astype(np.int64)
        )

    # ---------------------------------------------------------------- changes

    def take_slots(
        self, count: int, keep: np.ndarray, demand: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Free ``count`` pool slots for new experts of this layer and return ``(slots,
        evicted experts)``. Free slots go first; then the slots of the pool's
        :meth:`~SlotPool.victims` (in a shared pool they may be other layers')."""
        free = self.pool.free_slots()
        if len(free) >= count:
            return free[:count], free[:0]
        owners, candidates = self.pool.victims(self, keep, demand)
        need = count - len(free)
        if len(candidates) < need:
            raise RuntimeError(
                f"{self.experts.name}: cannot free {need} slots (capacity check skipped?)"
            )
        owners, victims = owners[:need], candidates[:need]
        freed = [
            self.pool.caches[owner].release(victims[owners == owner]) for owner in np.unique(owners)
        ]
        return np.concatenate([free, *freed]), victims

    def assign(self, experts: np.ndarray, slots: np.ndarray) -> None:
        """Record that ``slots`` (free) now hold ``experts`` (not resident)."""
        self.slot_expert[slots] = experts
        self.pool.owner[slots] = self.index
        self.expert_slot[experts] = slots
        self._map_dirty[experts] = True

    def release(self, experts: np.ndarray) -> np.ndarray:
        """Forget resident ``experts``; returns the slots they held, now free."""
        slots = self.expert_slot[experts].astype(np.int64)
        self.expert_slot[experts] = -1
        self.slot_expert[slots] = -1
        self.pool.owner[slots] = -1
        self.protected[experts] = False
        self._map_dirty[experts] = True
        self.identity = False
        return slots

    def touch(self, experts: np.ndarray) -> None:
        """``experts`` are used by a kernel call now (eviction order)."""
        self.pool.clock += 1
        self.policy.on_use(experts, self.pool.clock)
