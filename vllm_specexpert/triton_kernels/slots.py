"""Slot-pool kernels: the device id -> slot map, and experts copied into slots.

The id -> slot map (``int32 [E]``, -1 where an expert is not resident) is what the fused
MoE kernel reads as ``expert_map``. It lives on the device and is changed only by
:func:`update_slot_map`, enqueued on the compute stream right before the layer's next
kernel, after that stream waited for the copies the kernel uses (see
:class:`~vllm_specexpert.tiers.cache.ExpertCache`): the kernel sees the map and the bytes
together, and no host read of the map is ever needed.

:func:`copy_experts` moves any number of experts in one launch: every program copies one
block of one expert's row from the slow tier into its slot, for all weight tensors of
the layer at once. On CUDA the slow tier is pinned host memory seen through a UVA
device view, so the copy runs on the SMs of the stream it is launched on (not on the
copy engine): one launch instead of one ``cudaMemcpyAsync`` per expert and tensor. The
price is a few SMs taken from the compute while a copy runs; the copy engine would
leave them alone but costs a call per tensor (a choice to revisit with GPU numbers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def update_slot_map_kernel(map_ptr, experts_ptr, slots_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    expert = tl.load(experts_ptr + i, mask=mask, other=0)
    slot = tl.load(slots_ptr + i, mask=mask, other=0)
    tl.store(map_ptr + expert, slot, mask=mask)


def update_slot_map(slot_map: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor) -> None:
    """``slot_map[experts[i]] = slots[i]`` (``-1``: evicted), in one launch. ``experts``
    must be distinct (an eviction and an admission of the same expert in one update
    would race)."""
    n = experts.numel()
    if n == 0:
        return
    block = min(1024, triton.next_power_of_2(n))
    update_slot_map_kernel[(triton.cdiv(n, block),)](slot_map, experts, slots, n, BLOCK=block)


@triton.jit
def copy_experts_kernel(
    src0_ptr,
    dst0_ptr,
    row0,  # first weight tensor: [E, ...] -> [slots, ...]
    src1_ptr,
    dst1_ptr,
    row1,  # second weight tensor (w2), same experts
    experts_ptr,
    slots_ptr,
    blocks0,  # programs along axis 1 that copy tensor 0
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    j = tl.program_id(1)
    expert = tl.load(experts_ptr + i).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    if j < blocks0:
        offsets = j * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < row0
        values = tl.load(src0_ptr + expert * row0 + offsets, mask=mask)
        tl.store(dst0_ptr + slot * row0 + offsets, values, mask=mask)
    else:
        offsets = (j - blocks0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < row1
        values = tl.load(src1_ptr + expert * row1 + offsets, mask=mask)
        tl.store(dst1_ptr + slot * row1 + offsets, values, mask=mask)


def copy_experts(
    sources: tuple[torch.Tensor, torch.Tensor],
    destinations: tuple[torch.Tensor, torch.Tensor],
    experts: torch.Tensor,
    slots: torch.Tensor,
    block: int = 4096,
) -> None:
    """``destinations[n][slots[i]] = sources[n][experts[i]]`` for both tensors ``n`` and
    every ``i``, in one launch. Sources ``[E, ...]`` and destinations ``[slots, ...]``
    are contiguous with equal rows; ``experts`` and ``slots`` are int32/int64 on the
    device (``slots`` distinct)."""
    n = experts.numel()
    if n == 0:
        return
    rows = []
    for src, dst in zip(sources, destinations, strict=True):
        assert src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype
        assert src[0].numel() == dst[0].numel(), "a slot row differs from an expert row"
        rows.append(src[0].numel())
    blocks0 = triton.cdiv(rows[0], block)
    grid = (n, blocks0 + triton.cdiv(rows[1], block))
    copy_experts_kernel[grid](
        sources[0],
        destinations[0],
        rows[0],
        sources[1],
        destinations[1],
        rows[1],
        experts,
        slots,
        blocks0,
        BLOCK=block,
    )
