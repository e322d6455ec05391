"""ExpertCache: which of one MoE layer's routed experts sit in device slots.

Residency and eviction only (id <-> slot maps, eviction policy, protected experts);
moving bytes is :class:`~vllm_specexpert.tiers.loader.ExpertLoader`'s. The slots are a
:class:`~vllm_specexpert.tiers.slots.SlotPool`, the layer's own or shared (``plec``).
:meth:`ExpertCache.kernel_routing` tells a kernel where an expert's slot is: slot indices
mapped on the host (CPU), or a device ``expert_map`` (CUDA; docs/design.md, "The layer,
the slow tier and the cache").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import torch

from vllm_specexpert.tiers.eviction import CACHE_CLASSES
from vllm_specexpert.tiers.link import ExpertCopy
from vllm_specexpert.tiers.slots import LayerSlotPool, SlotPool
from vllm_specexpert.tiers.staging import upload
from vllm_specexpert.tiers.store import ExpertSource, ExpertsUnreadable


def write_slot_map(expert_map: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor) -> None:
    """``expert_map[experts] = slots`` where the map lives, in one launch (Triton: the
    device map is CUDA's way of finding slots)."""
    from vllm_specexpert.triton_kernels.slots import update_slot_map

    update_slot_map(expert_map, experts, slots)


class KernelRouting(NamedTuple):
    """What a launch on resident experts hands the kernel besides its rows."""

    ids: torch.Tensor
    """The routing's ids, or slot indices (same shape and dtype)."""
    slots: dict[str, torch.Tensor]
    """The slot pool's tensors."""
    expert_map: torch.Tensor | None
    """Expert id -> slot on the device, where ``ids`` are expert ids not slots."""


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
        own = experts.kernel_pool(device) if pool is None else None
        if own is not None:  # every expert where the kernel reads it: no budget of slots
            num_slots = num_experts
        if not top_k <= num_slots <= num_experts:
            raise ValueError(
                f"{experts.name}: need top_k ({top_k}) <= slots ({num_slots}) <= "
                f"experts ({num_experts})"
            )
        self.experts = experts
        self.num_slots = num_slots
        """Its own pool's size, or its warm-start share of a shared pool."""
        self.num_experts = num_experts
        self.top_k = top_k
        self.device = device
        self.policy = CACHE_CLASSES[policy](num_experts, num_slots, top_k)
        self.rotating_slots = num_slots - int(self.policy.pinned.sum())
        """Slots never held by a pinned expert: any batch of this many experts fits."""
        self.pool = pool if pool is not None else own if own is not None else LayerSlotPool(device)
        self.index = self.pool.join(self, num_slots)
        self.slot_expert = np.zeros(0, dtype=np.int64)
        """Pool slot -> this layer's expert in it, -1 for none."""
        self.expert_slot = np.full(num_experts, -1, dtype=np.int32)
        """Expert -> its pool slot, -1 when not resident (the id -> slot map)."""
        self.in_use = np.zeros(num_experts, dtype=bool)
        """Experts a launch is about to read: in a shared pool other layers' loads,
        which run between acquire and launch, must not take them."""
        self.protected = np.zeros(num_experts, dtype=bool)
        """Prefetched experts whose layer has not run since: never evicted."""
        self.recency_frozen = False
        """Uses leave the eviction order as it is (:meth:`frozen_recency`)."""
        if device_map is None:
            device_map = device.type != "cpu"
        self.expert_map: torch.Tensor | None = (
            torch.full((num_experts,), -1, dtype=torch.int32, device=device) if device_map else None
        )
        """``int32 [E]`` id -> slot map on the device; ``None``: mapped on the host."""
        self._map_dirty = np.zeros(num_experts, dtype=bool)
        self.unreadable: ExpertsUnreadable | None = None
        """What the last warm start could not read (those experts are not resident)."""
        self.identity = False
        """Every expert sits in the slot of its own id (an own pool holding them all)
        and the kernel reads it as it is (not a mapped pack's pages, made readable
        first); an eviction ends it, and then calls :attr:`identity_lost`."""
        self.identity_lost: Callable[[], None] | None = None
        """Whoever composed a call on the identity (the engine) hears that it ended."""
        if pool is None or not pool.shared:  # (a shared pool: once every layer joined)
            self.pool.allocate()

    def warm_start(self, offset: int, count: int) -> None:
        """Fill slots ``offset ..`` with the first ``count`` experts (``static``: the
        pinned). Those the slow tier cannot supply are left out, in :attr:`unreadable`
        (read on demand later; whoever started the cache decides what that means)."""
        self.slot_expert = np.full(self.pool.num_slots, -1, dtype=np.int64)
        self.assign(np.arange(count), np.arange(offset, offset + count))
        self.identity = (
            count == self.num_experts and not self.pool.shared and self.pool.readable_as_is
        )
        self.unreadable = None
        # Through the source's own copy: the disk's read window, as a miss (staging_nbytes).
        device = self.device if self.device.type != "cpu" else None
        try:
            self.experts.copy_into(
                np.arange(count), np.arange(offset, offset + count), self.slots, device
            )
        except ExpertsUnreadable as error:  # (their slots hold no expert: freed)
            self.release(np.asarray(error.experts, dtype=np.int64))
            self.unreadable = error

    @property
    def slots(self) -> dict[str, torch.Tensor]:
        return self.pool.tensors

    # ------------------------------------------------------------------ queries

    def resident_mask(self) -> np.ndarray:
        return self.expert_slot >= 0

    def needs_read(self, experts: np.ndarray) -> np.ndarray:
        """``bool``, the shape of ``experts``: which a launch would have to read first
        (not held in a slot, or held where the pool must read it: a mapped pack's pages
        the page cache lacks). What a prefetch can save a read of."""
        slot = self.expert_slot[experts]
        flat = slot.reshape(-1)
        needed = flat < 0
        if not self.pool.readable_as_is:
            held = np.flatnonzero(~needed)
            unique, back = np.unique(flat[held], return_inverse=True)
            needed[held] = self.pool.unreadable(unique)[back]
        return needed.reshape(slot.shape)

    def pin(self, experts: np.ndarray) -> None:
        """Never evict ``experts`` (resident now): the slots they hold no longer rotate."""
        self.policy.pinned[experts] = True
        self.rotating_slots = self.num_slots - int(self.policy.pinned.sum())

    def num_resident(self) -> int:
        return int(np.count_nonzero(self.slot_expert >= 0))

    def capacity_for(self, experts: np.ndarray) -> bool:
        return self.pool.capacity_for(self, experts)

    def capacity(self) -> int:
        return self.pool.capacity(self)

    def evictable(self, keep: np.ndarray) -> np.ndarray:
        """Resident experts that may be evicted now, other than ``keep``."""
        evictable = self.evictable_mask()
        evictable[keep] = False
        return np.flatnonzero(evictable)

    def evictable_mask(self) -> np.ndarray:
        """``bool [E]``: resident experts neither pinned, protected nor in use."""
        return self.resident_mask() & ~self.policy.pinned & ~self.protected & ~self.in_use

    def kernel_routing(self, topk_ids: torch.Tensor, host_ids: np.ndarray | None) -> KernelRouting:
        """The routing of a launch on ``topk_ids`` (all resident): the ids with the
        flushed device map, else slot indices. ``host_ids`` are needed only without a
        device map or ``identity``."""
        if self.expert_map is not None:
            self.flush_map()
            return KernelRouting(topk_ids, self.pool.tensors, self.expert_map)
        if self.identity:
            return KernelRouting(topk_ids, self.pool.tensors, None)
        slots = torch.from_numpy(self.expert_slot[host_ids])
        ids = slots if slots.dtype == topk_ids.dtype else slots.to(topk_ids.dtype)
        return KernelRouting(ids, self.pool.tensors, None)

    def flush_map(self) -> None:
        """Write the dirty entries of ``expert_map`` (one upload and one launch, if any)."""
        changed = np.flatnonzero(self._map_dirty)
        expert_map = self.expert_map
        if not len(changed) or expert_map is None:
            return
        self._map_dirty[changed] = False
        update = upload(
            np.stack([changed, self.expert_slot[changed]]).astype(np.int32), self.device
        )
        write_slot_map(expert_map, update[0], update[1])

    # ---------------------------------------------------------------- changes

    def assign(self, experts: np.ndarray, slots: np.ndarray) -> ExpertCopy:
        """Record that ``slots`` (free) now hold ``experts`` (not resident); returns the
        transfer that fills them from the slow tier."""
        self.slot_expert[slots] = experts
        self.pool.claim(slots, self.index)
        self.expert_slot[experts] = slots
        self._map_dirty[experts] = True
        return ExpertCopy(self.experts, self.pool.tensors, experts, slots.astype(np.int64))

    def release(self, experts: np.ndarray) -> np.ndarray:
        """Forget resident ``experts``; returns their slots, now free."""
        slots = self.expert_slot[experts].astype(np.int64)
        self.expert_slot[experts] = -1
        self.slot_expert[slots] = -1
        self.pool.free(slots)
        self.protected[experts] = False
        self._map_dirty[experts] = True
        if self.identity:
            self.identity = False
            if self.identity_lost is not None:
                self.identity_lost()
        return slots

    def touch(self, experts: np.ndarray, tokens: int = 1) -> None:
        """``experts`` are used by a kernel call of ``tokens`` tokens now (eviction
        order)."""
        if self.recency_frozen:
            return
        self.policy.on_use(experts, self.pool.tick(), tokens)

    @contextlib.contextmanager
    def frozen_recency(self) -> Iterator[None]:
        """Uses inside leave the eviction order as it is: the prompt rows of a pass that
        also decodes load what they need on demand, and those experts go before the
        decode set (a long prompt cycles through the slots instead of pushing out what
        the decoding requests use at every step)."""
        self.recency_frozen = True
        try:
            yield
        finally:
            self.recency_frozen = False
