"""What the ``lookahead`` draft's layers take of memory. vLLM builds the draft right after
its target, whose slots are sized first: each target layer counts what its twin in the
draft will take (:func:`twin_bytes`), and each draft layer's engine config gives its
slots (:func:`draft_layer_config`). Where the draft computes its INT4 experts packed
(:func:`computed_packed`), its slots hold them as the pack does and are its only cache.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.platforms import current_platform

from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.layers.engines import current_target
from vllm_specexpert.layers.int4_copies import Int4DraftForm
from vllm_specexpert.layers.packed_experts import low_bit_parameters
from vllm_specexpert.tiers.expert_pack import DRAFT_PREFIX


def computed_packed(config: SpecExpertConfig, dtype: torch.dtype, moe_config: Any) -> bool:
    """A draft layer of ``moe_config``'s sizes computes its INT4 experts packed: on the
    disk tier (the pack holds them in the GEMM's form), where this build's GEMM takes
    them in ``dtype``. Its slots then hold them as the pack does, and are its only cache
    (no host rows)."""
    return config.disk is not None and Int4DraftForm(dtype).computed_packed(
        moe_config.hidden_dim, moe_config.intermediate_size_per_partition
    )


def draft_layer_config(config: SpecExpertConfig, moe_config: Any, packed: bool) -> SpecExpertConfig:
    """A draft layer's engine config, from its target's ``config``. Computed ``packed``,
    its slots are its only cache: unless ``draft_budget`` says, as many per layer as
    ``lookahead.draft_cache`` gives (``auto``: the target's slots)."""
    top_k = moe_config.experts_per_token
    if not packed:
        return config.draft_config(top_k)
    target = current_target()
    plan = target.budget.current if target is not None else None
    assert plan is not None  # (vLLM loads the target before it builds the draft)
    experts = moe_config.num_experts
    # (the target's slots once the draft drafts: its rows are lent to them until then)
    rows = config.draft_cache_rows(experts, top_k, plan.drafting().slots(experts, top_k))
    return config.draft_config(top_k, slots=rows)


def twin_bytes(
    config: SpecExpertConfig, layer_name: str, moe_config: Any, dtype: Any
) -> tuple[int, int, int, int]:
    """What target layer ``layer_name``'s twin in the ``lookahead`` draft will take of
    the memory the slots are sized from (its slots, its INT4 experts on the CPU build),
    of the host's apart from it (CUDA: its INT4 experts, which the host cache is sized
    around), and per slot of this layer (its INT4 rows sized with the slots), for the
    model's ``dtype``; 0s without a draft, and for a draft's own layer."""
    if config.lookahead is None or layer_name.startswith(DRAFT_PREFIX):
        return 0, 0, 0, 0
    num_experts, top_k = moe_config.num_experts, moe_config.experts_per_token
    on_disk = config.disk is not None
    follow = config.draft_rows_follow_slots
    # Every INT4 expert in memory; on disk, its rows: a share, or (following the
    # slots) one per slot, counted per slot below; CUDA's host sizing, at most all.
    int4_experts = (
        num_experts
        if not on_disk or follow
        else config.draft_cache_rows(num_experts, top_k, num_experts)
    )
    hidden, intermediate = moe_config.hidden_dim, moe_config.intermediate_size_per_partition
    if computed_packed(config, dtype, moe_config):
        # Its INT4 slots are its only cache: fixed, or one per slot of the target's.
        expert = _int4_expert_bytes(layer_name, hidden, intermediate)
        if config.lookahead.draft_budget is None and follow:
            return 0, 0, 0, expert
        rows = config.draft_cache_rows(num_experts, top_k, num_experts)
        own = config.draft_config(top_k, slots=rows)
        return own.slots_per_layer(num_experts, top_k) * expert, 0, 0, 0
    # Its slots decoded (experts in ``dtype``, on the device), its INT4 experts held in
    # host memory.
    slots = config.draft_config(top_k).slots_per_layer(num_experts, top_k)
    slot_bytes = slots * 3 * hidden * intermediate * dtype.itemsize
    int4 = int4_experts * _int4_expert_bytes(layer_name, hidden, intermediate)
    if not current_platform.is_cpu():  # (the draft's INT4 experts are the host's)
        return slot_bytes, 0, int4, 0
    if follow:
        return slot_bytes, 0, 0, int4 // num_experts
    return slot_bytes, int4, 0, 0


def _int4_expert_bytes(layer_name: str, hidden: int, intermediate: int) -> int:
    return low_bit_parameters(layer_name, 1, hidden, intermediate).expert_nbytes
