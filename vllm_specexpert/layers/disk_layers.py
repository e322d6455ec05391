"""The disk tier's side of the adapter: a layer's experts read from the engine's pack,
checked against the kernel vLLM's layer really runs; on CUDA through pinned host rows;
the lookahead draft's INT4 experts from the pack's draft regions (docs/design.md, "The
disk tier"). The slow tier's adapter (:mod:`.slow_tier`) calls :func:`experts` for the
layers the disk serves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_specexpert.budget_plan import size_host_cache
from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.layers import int4_copies
from vllm_specexpert.layers.engines import target_of
from vllm_specexpert.layers.pack_form_check import check_pack_form
from vllm_specexpert.layers.packed_experts import PackedDecoder, low_bit_parameters
from vllm_specexpert.tiers.disk import Disk, DiskExperts
from vllm_specexpert.tiers.host_cache import HostCache, HostCachedExperts
from vllm_specexpert.tiers.kernel_form import DTYPE_NAMES
from vllm_specexpert.tiers.mapped import MappedExperts
from vllm_specexpert.tiers.store import SlotShapes

TIER = Disk.name

PackedLayer = DiskExperts | MappedExperts | HostCachedExperts

TierLayer = Callable[[Any, Any, Any, SlotShapes, bool, bool], tuple[Any, PackedDecoder | None]]
"""``(layer, tier, form, slot_shapes, draft, draft_packed) -> (experts, decoder)``: a
layer's experts from a slow tier, read through its adapter (``draft``: the lookahead
draft's layer; ``draft_packed``: it computes its INT4 experts packed)."""


def experts(
    layer: Any, disk: Any, form: Any, slot_shapes: SlotShapes, draft: bool, draft_packed: bool
) -> tuple[PackedLayer, PackedDecoder | None]:
    """``layer``'s experts in ``disk`` (its engine's pack; a draft layer's: its target's)."""
    assert isinstance(disk, Disk)  # (registered for the disk tier)
    if draft:
        return _draft_experts(layer, disk, form, slot_shapes, draft_packed)
    return _target_experts(layer, disk, slot_shapes), None


def _target_experts(layer: Any, disk: Disk, slot_shapes: SlotShapes) -> PackedLayer:
    """The layer's experts in the engine's pack, refused unless they are what its
    kernel reads; on CUDA read through pinned host rows, sized at the first layer
    (once vLLM's settings and the MoE layers are known)."""
    engine = layer.engine
    if engine.device.type == "cuda" and disk.host_cache is None:
        fit = size_host_cache(
            engine.config, engine.budget.sizing, disk.layer(layer.layer_name), layer.top_k
        )
        disk.host_cache = HostCache(fit.slots_per_layer, pinned=True)
    found = disk.layer(layer.layer_name)
    check_pack_form(layer, found, slot_shapes, layer.checkpoint, engine.unreadable)
    return found


def _draft_experts(
    layer: Any, disk: Disk, form: Any, slot_shapes: SlotShapes, draft_packed: bool
) -> tuple[PackedLayer, PackedDecoder | None]:
    """The draft's INT4 experts in the target's pack: read straight into its slots
    where it computes them packed, else through its host rows
    (``lookahead.draft_cache``, made at its first layer) and decoded; refused if the
    pack holds them in another layout than this build's."""
    target = target_of(layer.engine)
    moe = layer.moe_config
    hidden, intermediate = moe.hidden_dim, moe.intermediate_size_per_partition
    record = disk.record_of(layer.layer_name)
    dtype = layer.w13_weight.dtype
    checkpoint = [
        ("w13_weight", (2 * intermediate, hidden), dtype),
        ("w2_weight", (hidden, intermediate), dtype),
    ]
    form_specs = int4_copies.Int4DraftForm(dtype).specs(checkpoint)
    want = {name: (list(shape), DTYPE_NAMES[d]) for name, shape, d in form_specs}
    have = {t.name: (t.shape, t.dtype) for t in record.tensors}
    if have != want:
        raise SpecExpertConfigError(
            "disk.path",
            f"{disk.pack.path}: the draft's experts of {layer.layer_name} are {have}, "
            f"this build's INT4 draft reads {want}",
            f"`specexpert pack {layer.checkpoint} --out {disk.pack.path} --draft` writes "
            "them again",
        )
    if draft_packed:  # (its slots are its cache: read into them, no rows)
        return disk.layer(layer.layer_name), None
    num_experts, top_k = layer.global_num_experts, layer.top_k
    parameters = low_bit_parameters(layer.layer_name, num_experts, hidden, intermediate)
    decoder = PackedDecoder(parameters, form, slot_shapes)
    if disk.draft_cache is None:
        plan = target.budget.current
        assert plan is not None  # (the target's layers were equipped first)
        target_slots = plan.drafting().slots(num_experts, top_k)
        rows = target.config.draft_cache_rows(num_experts, top_k, target_slots)
        disk.draft_cache = HostCache(rows, pinned=False)
    return disk.layer(layer.layer_name, decoder), decoder
