"""INT4 copies of a layer's experts (``lowbit``'s format): ``lowbit``'s beside the
layer's experts, the ``lookahead`` draft's instead of them; what the draft's twin of a
target layer will take of the device's memory and of the host's.

The copies are made from vLLM's checkpoint layout, before the quant method's
post-processing (on CPU a prepacked layout, whose groups would mix rows), or, under the
disk tier, which loads no expert, from the checkpoint one expert at a time.
"""

from __future__ import annotations

import torch

from vllm_specexpert.layers.packed_experts import LOW_BIT_BITS, PackedParameters, low_bit_parameters
from vllm_specexpert.tiers.checkpoint_experts import CheckpointExperts

Copies = tuple[PackedParameters, dict[str, torch.Tensor]]
"""A layer's experts in one format: the format and its tensors (``[E, ...]`` each)."""


def of_weights(layer_name: str, weights: dict[str, torch.Tensor]) -> Copies:
    """INT4 copies of a layer's bf16 ``weights`` (``w13_weight`` ``[E, 2I, H]``, ...)."""
    experts, twice_intermediate, hidden = weights["w13_weight"].shape
    parameters = low_bit_parameters(layer_name, experts, hidden, twice_intermediate // 2)
    return parameters, parameters.quantize(weights)


def of_packed(layer_name: str, packed: Copies) -> Copies:
    """INT4 copies of a quantized checkpoint's ``packed`` experts (FP8, ...)."""
    source, tensors = packed
    hidden, intermediate = source.features["w2"]
    parameters = low_bit_parameters(layer_name, source.num_experts, hidden, intermediate)
    return parameters, source.requantize(tensors, parameters)


def of_checkpoint(
    checkpoint: str, layer_name: str, module: str, num_experts: int, dtype: torch.dtype
) -> Copies:
    """INT4 copies of the checkpoint's ``module`` experts, each read in ``dtype`` and
    quantized in turn (a layer's experts need not fit in memory together)."""
    read = CheckpointExperts(checkpoint)
    parameters: PackedParameters | None = None
    copies = []
    for expert in range(num_experts):
        weights = {k: t[None].to(dtype) for k, t in read(module, expert).items()}
        if parameters is None:
            _, twice_intermediate, hidden = weights["w13_weight"].shape
            intermediate = twice_intermediate // 2
            parameters = low_bit_parameters(layer_name, num_experts, hidden, intermediate)
        copies.append(parameters.quantize(weights))
    assert parameters is not None  # (a layer has experts)
    return parameters, {k: torch.cat([c[k] for c in copies]) for k in copies[0]}


def draft_twin_bytes(
    layer_name: str,
    num_experts: int,
    hidden: int,
    intermediate: int,
    decoded_slots: int,
    dtype: torch.dtype,
) -> tuple[int, int]:
    """What a target layer's twin in the ``lookahead`` draft, built after the target's
    slots are sized, will take: its ``decoded_slots`` (experts in ``dtype``, on the
    device) and its INT4 experts (in host memory), in bytes."""
    decoded = decoded_slots * 3 * hidden * intermediate * dtype.itemsize
    int4 = low_bit_parameters(layer_name, num_experts, hidden, intermediate)
    return decoded, num_experts * int4.expert_nbytes


def keeps_packed(packed: Copies | None) -> bool:
    """A 4-bit checkpoint's experts serve the draft as they are: already as small as an
    INT4 copy, and quantizing them again would only add error."""
    return packed is not None and packed[0].format.bits <= LOW_BIT_BITS
