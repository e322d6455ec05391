"""One offloaded layer's experts on their way into the slow tier: where vLLM allocates
them and what the engine's store is handed once they are loaded.

vLLM's own loader and quant method load them (``requires_device_loading = False``), on
the host: on CUDA, ``torch.device("cpu")`` around the quant method's ``create_weights``
only (pinned in place by the store); post-processed there. A quantized checkpoint's
experts stay packed (:mod:`.packed_experts`) and are decoded into slots; experts on the
disk tier are not loaded at all (one expert for vLLM's kernel setup: the pack holds
them), and reach the device through pinned host rows on CUDA, sized at the first layer.
``lowbit``'s INT4 copies go beside a layer's experts; the ``lookahead`` draft's layers
get INT4 copies instead, or on the disk tier the pack's draft regions. The device only
ever holds the cache's slot pool.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from vllm.platforms import current_platform

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.layers import disk_layers, draft_sizing, int4_copies
from vllm_specexpert.layers.engines import target_of
from vllm_specexpert.layers.packed_experts import (
    PackedDecoder,
    PackedParameters,
    runtime_form,
)
from vllm_specexpert.quant_formats import PackedFormat
from vllm_specexpert.tiers import slow_tiers
from vllm_specexpert.tiers.store import LOW_BIT_SUFFIX, ExpertSource, LayerExperts, SlotShapes

EXPERT_TENSORS = ("w13_weight", "w2_weight", "w13_bias", "w2_bias")
"""Per-expert tensors of a bf16 layer (the biases where the model has them, GPT-OSS)."""


def _host_allocation() -> contextlib.AbstractContextManager:
    """Where the layer's parameters are allocated: host on GPU platforms."""
    if current_platform.is_cpu():
        return contextlib.nullcontext()
    return torch.device("cpu")


class SlowTier:
    """Where ``layer``'s experts come from and where they go (see module doc): made before
    vLLM creates the layer's weights, it has the layer's quant method allocate them
    (:meth:`load_through`) and hands them to the layer's engine once loaded."""

    def __init__(
        self,
        layer: Any,  # the adapter's layer (named, not imported: it imports this module)
        config: SpecExpertConfig,
        packed_format: PackedFormat | None,
        draft: bool,
        model: str,
    ) -> None:
        self.layer = layer
        self.packed_format = packed_format
        """The checkpoint's format of the layer's experts (``None``: unquantized)."""
        self.config = config
        self.from_tier = slow_tiers.configured(config, model) is not None
        """The experts are read from a slow tier (the disk's pack): vLLM loads none."""
        self.draft = draft
        """The layer is the lookahead draft's: INT4 experts."""
        self._packed: PackedParameters | None = None

    @property
    def draft_packed(self) -> bool:
        """This draft layer computes its INT4 experts packed: its slots hold them as the
        pack does, and are its only cache (no host rows). Known once vLLM has sized the
        layer (its sizes are rounded up for the kernel)."""
        layer = self.layer
        return self.draft and draft_sizing.computed_packed(
            self.config, layer.params_dtype, layer.moe_config
        )

    def load_through(self, method: Any, prefix: str) -> None:
        """Have vLLM's quant ``method`` (the layer's own instance, patched) allocate the
        expert weights on the host (only them: whatever else the layer allocates stays
        on the device) and post-process them there, then hand them to the store."""
        create_weights = method.create_weights
        post_process = method.process_weights_after_loading

        def create_weights_on_host(
            layer: Any,
            num_experts: int,
            hidden_size: int,
            intermediate_size_per_partition: int,
            **kwargs: Any,
        ) -> None:
            with _host_allocation():
                if self.from_tier:
                    # One expert (vLLM's kernel setup): the pack holds them all.
                    return create_weights(
                        layer, 1, hidden_size, intermediate_size_per_partition, **kwargs
                    )
                if self.packed_format is None:
                    return create_weights(
                        layer, num_experts, hidden_size, intermediate_size_per_partition, **kwargs
                    )
                # One expert of bf16 parameters (vLLM's kernel setup), all experts packed.
                create_weights(layer, 1, hidden_size, intermediate_size_per_partition, **kwargs)
                self._packed = PackedParameters(
                    self.packed_format,
                    prefix,
                    num_experts,
                    hidden_size,
                    intermediate_size_per_partition,
                )
                self._packed.create(layer)

        def process_weights_after_loading(layer: Any) -> None:
            packed = (self._packed, self._packed.take(layer)) if self._packed is not None else None
            # INT4 copies are made from vLLM's checkpoint layout, before its
            # post-processing (on CPU a prepacked layout: groups of it would mix rows):
            # lowbit's beside the experts, or the lookahead draft's instead of them.
            low_bit = None
            if self.draft and not self.from_tier:  # (on disk, the pack holds the draft's)
                packed = packed if int4_copies.keeps_packed(packed) else self._int4_copies(packed)
            elif packed is None and self.layer.engine.config.miss_policy_spec.low_bit:
                low_bit = self._int4_copies(None)
            post_process(layer)
            self._move_experts_to_store(packed, low_bit)

        method.create_weights = create_weights_on_host
        method.requires_device_loading = False
        method.process_weights_after_loading = process_weights_after_loading

    def _int4_copies(self, packed: int4_copies.Copies | None) -> int4_copies.Copies:
        """INT4 copies of this layer's experts from where they are: a quantized
        checkpoint's ``packed`` ones, or the loaded bf16 ones."""
        layer = self.layer
        if packed is not None:
            return int4_copies.of_packed(layer.layer_name, packed)
        weights = {
            name: getattr(layer, name).data for name in EXPERT_TENSORS if hasattr(layer, name)
        }
        return int4_copies.of_weights(layer.layer_name, weights)

    def _move_experts_to_store(
        self,
        packed: int4_copies.Copies | None,
        low_bit: int4_copies.Copies | None = None,
    ) -> None:
        """Hand the runtime-format expert tensors (or the ``packed`` ones: a quantized
        checkpoint's, or the draft's INT4 copies) to the slow tier, with ``lowbit``'s
        INT4 copies if made; keep only views (packed: a one-expert placeholder). An
        expert is its weights and, where the model has them, its biases."""
        layer = self.layer
        # What a slot holds: the runtime form of one expert.
        slot_shapes = {
            name: (tuple(getattr(layer, name).shape[1:]), getattr(layer, name).dtype)
            for name in EXPERT_TENSORS
            if hasattr(layer, name)
        }
        form = functools.partial(runtime_form, layer)
        experts: dict[str, torch.Tensor] | ExpertSource
        if self.from_tier:
            experts, decoder = self._experts_from_tier(form, slot_shapes)
        elif packed is None:
            experts = {name: getattr(layer, name).data for name in slot_shapes}
            decoder = None
        else:
            parameters, experts = packed
            decoder = PackedDecoder(parameters, form, slot_shapes)
            for name in slot_shapes:  # the kernel runs on slots: keep one expert's shape
                getattr(layer, name).data = getattr(layer, name).data[:1].clone()
        engine = layer.engine
        if low_bit is not None:  # beside the layer's experts, found there by the layer
            parameters, copies = low_bit
            engine.store.add_layer(
                layer.layer_name + LOW_BIT_SUFFIX,
                copies,
                PackedDecoder(parameters, form, slot_shapes),
            )
        added = engine.add_layer(
            layer.layer_name,
            experts,
            layer.top_k,
            index=layer.layer_index,
            host_kernel=layer.slot_kernel.host_kernel(),
            decoder=decoder,
            pool_reach=layer.slot_kernel.pool_reach,
        )
        if packed is None and isinstance(added.experts, LayerExperts):
            # The parameters now alias the store's (pinned) tensors instead of a copy.
            for name, tensor in added.experts.tensors.items():
                getattr(layer, name).data = tensor

    def _experts_from_tier(
        self, form: Any, slot_shapes: SlotShapes
    ) -> tuple[ExpertSource, PackedDecoder | None]:
        """The layer's experts in the slow tier that serves them: through the tier's
        adapter where it has one (:data:`TIER_LAYERS`), else as the tier gives them."""
        layer = self.layer
        engine = target_of(layer.engine) if self.draft else layer.engine
        tier = engine.store.tiers[0]
        adapter = TIER_LAYERS.get(tier.name)
        if adapter is not None:
            return adapter(layer, tier, form, slot_shapes, self.draft, self.draft_packed)
        if self.draft:
            raise SpecExpertConfigError(
                "lookahead",
                f"the draft's INT4 experts are read from a disk pack, and {tier.name} holds none",
                "remove lookahead, or serve the experts from a disk pack",
            )
        return tier.layer(layer.layer_name), None


TIER_LAYERS: dict[str, disk_layers.TierLayer] = {disk_layers.TIER: disk_layers.experts}
"""Slow tier -> how the adapter reads a layer's experts from it, where the tier needs
more of vLLM's layer than its name (checks against the kernel, CUDA host rows, the
draft's regions)."""
