"""ExpertCache: which of one MoE layer's routed experts sit in device slots.

Residency and eviction only: the id <-> slot maps, the eviction policy, and the experts
protected from eviction. Moving bytes into slots belongs to
:class:`~vllm_specexpert.loader.ExpertLoader`.

The slots themselves are a :class:`SlotPool`: expert-sized slots, one tensor per weight
name, allocated once at the budget, so no cache can ever hold more. Each layer has a pool
of its own (``lru``, ``lfu``, ``static``: a fixed count per layer), or every layer shares
one (``plec``, ExpertFlow's predictive locality-aware cache, §3.4): a layer then holds as
many slots as its experts win, and the victim of a load may belong to another layer,
chosen by the predicted uses still to come (:attr:`SlotPool.lookahead`), the least
recently used first among equals.

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
from vllm_specexpert.transfer import ExpertCopy, Transfer


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

_NO_EXPERTS = np.zeros(0, dtype=np.int64)


class SlotPool:
    """Expert-sized device slots shared by the caches of one or more MoE layers (see
    module doc), and what belongs to a slot rather than to an expert: the cache holding
    it, the copy into it that nobody has waited for yet, and on CUDA the events that
    order a new copy after the slot's last copy and last reader.

    Caches :meth:`join` with their share of slots; :meth:`allocate` then makes the
    tensors at the sum of the shares and warm-starts every cache in its share. A layer's
    own pool is allocated by its cache; a shared pool by the engine once every layer
    joined."""

    def __init__(self, device: torch.device, shared: bool):
        self.device = device
        self.shared = shared
        """Slots move between layers (``plec``); else one layer's own pool."""
        self.caches: list[ExpertCache] = []
        self._shares: list[int] = []
        self.tensors: dict[str, torch.Tensor] = {}
        """Weight name -> ``[num_slots, ...]`` slot tensor (what kernels run on)."""
        self.owner = np.zeros(0, dtype=np.int32)
        """Slot -> index in :attr:`caches` of the cache holding it, -1 when free."""
        self.in_flight: dict[int, Transfer] = {}
        """Slot -> the copy into it that nobody has waited for yet."""
        self.last_write: np.ndarray | None = None
        """CUDA: slot -> the last transfer into it (a new copy is ordered after it)."""
        self.last_read: np.ndarray | None = None
        """CUDA: slot -> event after the last kernel that read it."""
        self.clock = 0
        """Kernel calls so far, for every cache's recency (comparable across layers)."""
        self.lookahead: np.ndarray | None = None
        """Shared pool: ``[caches, experts]`` predicted uses still to come of each
        (layer, expert), set by the engine from the step's predicted demand; the fewest
        go first. ``None`` for a layer's own pool."""

    @property
    def num_slots(self) -> int:
        return len(self.owner)

    def join(self, cache: ExpertCache, share: int) -> int:
        """Add ``cache`` with ``share`` slots of its own at warm start; returns its index."""
        if self.caches:
            first = self.caches[0].experts
            if {k: (t.shape[1:], t.dtype) for k, t in first.tensors.items()} != {
                    k: (t.shape[1:], t.dtype) for k, t in cache.experts.tensors.items()}:
                raise ValueError(f"{cache.experts.name}: experts shaped unlike those of "
                                 f"{first.name} cannot share a slot pool")
        self.caches.append(cache)
        self._shares.append(share)
        return len(self.caches) - 1

    def allocate(self) -> None:
        """Allocate the slots (the sum of the shares) and warm-start every cache."""
        total = sum(self._shares)
        first = self.caches[0].experts.tensors
        self.tensors = {key: torch.empty((total, *t.shape[1:]), dtype=t.dtype,
                                         device=self.device) for key, t in first.items()}
        self.owner = np.full(total, -1, dtype=np.int32)
        self.in_flight.clear()
        if self.device.type == "cuda":
            self.last_write = np.full(total, None, dtype=object)
            self.last_read = np.full(total, None, dtype=object)
        if self.shared:
            self.lookahead = np.zeros((len(self.caches), self.caches[0].num_experts))
        offset = 0
        for cache, share in zip(self.caches, self._shares):
            cache.warm_start(offset, share)
            offset += share

    def free_slots(self) -> np.ndarray:
        return np.flatnonzero(self.owner < 0)

    def spare(self) -> int:
        """Slots that hold nothing predicted to be used (shared pool): free ones, and
        those of evictable experts with no predicted use still to come. Loads for
        predicted experts may take this many without evicting another prediction."""
        spare = len(self.free_slots())
        for cache in self.caches:
            candidates = cache.evictable(_NO_EXPERTS)
            spare += int(np.count_nonzero(self.lookahead[cache.index][candidates] == 0))
        return spare

    def victims(self, requester: ExpertCache, keep: np.ndarray,
                demand: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(cache indices, experts)`` that may be evicted now to make room for
        ``requester``, the first to go first; never ``keep`` (of ``requester``), pinned
        or protected experts. ``demand``: the requester's per-expert count of later uses
        in the same call (those go last). A layer's own pool: its policy's order, the
        least demanded first. A shared pool: every layer's evictable experts, those
        with no predicted use still to come first, then (Belady's rule, the next use
        known only by layer) the layer whose turn comes last, the fewest predicted uses,
        the least recently used."""
        if not self.shared:
            candidates = requester.policy.order(requester.evictable(keep))
            if demand is not None:
                # Stable sort keeps the policy order among equal demand.
                candidates = candidates[np.argsort(demand[candidates], kind="stable")]
            return np.full(len(candidates), requester.index, dtype=np.int32), candidates
        owners, experts, scores, turns, recency = [], [], [], [], []
        layers = len(self.caches)
        for cache in self.caches:
            candidates = cache.evictable(keep if cache is requester else _NO_EXPERTS)
            score = self.lookahead[cache.index][candidates]
            if cache is requester and demand is not None:
                score = score + demand[candidates] * 1e9  # needed by this very call
            owners.append(np.full(len(candidates), cache.index, dtype=np.int32))
            experts.append(candidates)
            scores.append(score)
            # Layers run in pool order, one after another: the layer whose turn comes
            # last goes first (the requester's own, a whole step away: 0 here), Belady's
            # rule on the cyclic layer order. Recency alone would evict the layers that
            # ran longest ago, the next ones to run.
            turns.append(np.full(len(candidates),
                                 (requester.index - cache.index) % layers))
            recency.append(cache.policy.last_used[candidates])
        scores = np.concatenate(scores)
        order = np.lexsort((np.concatenate(recency), scores, np.concatenate(turns),
                            scores > 0))
        return np.concatenate(owners)[order], np.concatenate(experts)[order]


class ExpertCache:
    """Residency of one MoE layer's routed experts in a :class:`SlotPool`."""

    def __init__(
        self,
        experts: LayerExperts,
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
        self.policy = EVICTION_POLICIES[policy](num_experts, num_slots, top_k)
        # Slots never held by a pinned expert: any batch of this many experts fits.
        self._rotating_slots = num_slots - int(self.policy.pinned.sum())
        self.pool = pool if pool is not None else SlotPool(device, shared=False)
        self.index = self.pool.join(self, num_slots)
        """This cache's index in the pool (:attr:`SlotPool.owner`)."""
        self.slot_expert = np.zeros(0, dtype=np.int64)
        """Pool slot -> the expert of this layer it holds, -1 when it holds none."""
        self.expert_slot = np.full(num_experts, -1, dtype=np.int32)
        """Expert -> its pool slot, -1 when not resident (the id -> slot map)."""
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
        for key, src in self.experts.tensors.items():
            self.slots[key][offset:offset + count].copy_(src[:count])
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
        if self.pool.shared:
            missing = np.count_nonzero(self.expert_slot[experts] < 0)
            return missing <= len(self.pool.free_slots()) + len(self.pool.victims(self, experts)[1])
        if len(experts) <= self._rotating_slots:
            return True
        pinned_resident = self.policy.pinned & self.resident_mask()
        outside = np.count_nonzero(~pinned_resident[experts])
        return outside <= self.num_slots - int(pinned_resident.sum())

    def capacity(self) -> int:
        """How many distinct experts of this layer can be resident at once now, counting
        only those that need a slot that pinned experts do not hold."""
        if self.pool.shared:
            resident = np.flatnonzero(self.resident_mask())
            return (len(resident) + len(self.pool.free_slots())
                    + len(self.pool.victims(self, resident)[1]))
        return self.num_slots - int(np.count_nonzero(self.policy.pinned & self.resident_mask()))

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
        freed = [self.pool.caches[owner].release(victims[owners == owner])
                 for owner in np.unique(owners)]
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
