"""INT4 copies of a layer's experts (``lowbit``'s format): ``lowbit``'s beside the
layer's experts, the ``lookahead`` draft's instead of them (what the draft's layers
take of memory: :mod:`.draft_sizing`).

The copies are made from vLLM's checkpoint layout, before the quant method's
post-processing (on CPU a prepacked layout, whose groups would mix rows). Under the disk
tier, which loads no expert, the draft's are the pack's draft regions, written one
expert at a time in :class:`Int4DraftForm`: the form the draft computes packed where the
build can (:mod:`.int4_gemm`), else ``lowbit``'s, decoded into its slots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from vllm_specexpert.layers import int4_gemm
from vllm_specexpert.layers.packed_experts import LOW_BIT_BITS, PackedParameters, low_bit_parameters
from vllm_specexpert.tiers.checkpoint_experts import TensorSpec

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


class Int4DraftForm:
    """The draft's experts as an expert pack holds them (``specexpert pack --draft``),
    made from one expert of the checkpoint read in the model's ``dtype``
    (:class:`~vllm_specexpert.tiers.expert_pack.DraftForm`): the GEMM's form where this
    build computes them packed (:meth:`computed_packed`), else ``lowbit``'s."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def computed_packed(self, hidden: int, intermediate: int) -> bool:
        """The draft computes its experts of these sizes packed: no decoded copies.
        (``lowbit``'s bytes of an expert bound the GEMM form's: the same codes, scales
        and zeros, less its shape tensors.)"""
        return int4_gemm.runs_packed(self.dtype, hidden, intermediate)

    def __call__(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        weights = {name: t[None].to(self.dtype) for name, t in tensors.items()}
        hidden, intermediate = weights["w2_weight"].shape[1:]
        if self.computed_packed(hidden, intermediate):
            return int4_gemm.expert_form({name: t[0] for name, t in weights.items()}, self.dtype)
        parameters = low_bit_parameters("the draft", 1, hidden, intermediate)
        return {name: t[0].contiguous() for name, t in parameters.quantize(weights).items()}

    def specs(self, specs: Sequence[TensorSpec]) -> list[TensorSpec]:
        # (a zero expert quantized: the one source of the format's shapes and dtypes)
        zero = self({name: torch.zeros(shape, dtype=self.dtype) for name, shape, _ in specs})
        return [(name, tuple(t.shape), t.dtype) for name, t in zero.items()]


def keeps_packed(packed: Copies | None) -> bool:
    """A 4-bit checkpoint's experts serve the draft as they are: already as small as an
    INT4 copy, and quantizing them again would only add error."""
    return packed is not None and packed[0].format.bits <= LOW_BIT_BITS
