"""A quantized checkpoint's routed experts, kept packed (see :mod:`vllm_specexpert.quant_formats`).

vLLM's quantized MoE methods cannot run here (every x86 CPU kernel needs AMX) and would
keep every expert on the device. The layer runs vLLM's unquantized method on one
expert's bf16 placeholders and registers the checkpoint's tensors as packed parameters,
``w13_<name> [E, 2, ...]`` and ``w2_<name> [E, ...]`` (``lowbit``'s INT4 copies too,
:func:`low_bit_parameters`). In the slow tier a :class:`PackedDecoder` turns moved
experts into slot contents: dequantize, then vLLM's bf16 post-processing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from vllm_specexpert.config import SpecExpertUnsupportedError
from vllm_specexpert.quant_formats import PackedFormat, PackQuantizedFormat
from vllm_specexpert.tiers.store import SlotShapes

PROJECTIONS = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}
"""vLLM shard id -> (parameter stem, index in the stem's projection axis)."""
BIASES = ("w13_bias", "w2_bias")


class PackedParameters:
    """One layer's packed experts in one format: as parameters a checkpoint loads into
    (created, loaded, taken off the layer), or quantized from bf16 (``lowbit``); and
    their dequantize."""

    def __init__(
        self, fmt: PackedFormat, layer_name: str, num_experts: int, hidden: int, intermediate: int
    ):
        self.format = fmt
        self.layer_name = layer_name
        self.shapes = {
            "w13": fmt.tensor_shapes(intermediate, hidden),
            "w2": fmt.tensor_shapes(hidden, intermediate),
        }
        self.features = {"w13": (intermediate, hidden), "w2": (hidden, intermediate)}
        self.num_experts = num_experts

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert's packed tensors (scales at their declared width: an upper
        bound of what :meth:`take` narrows them to)."""
        total = 0
        for stem, shapes in self.shapes.items():
            lead = 2 if stem == "w13" else 1
            for shape, dtype in shapes.values():
                total += lead * math.prod(shape) * dtype.itemsize
        return total

    def create(self, layer: torch.nn.Module) -> None:
        """Register ``w13_<name>``/``w2_<name>`` on ``layer`` (host memory), in place of
        the one-expert bf16 ``w13_weight``/``w2_weight`` (an FP8 checkpoint's packed
        tensor has that name too); :meth:`take` puts those back."""
        self.placeholders = {
            name: layer._parameters.pop(name) for name in ("w13_weight", "w2_weight")
        }
        for stem, shapes in self.shapes.items():
            lead = (self.num_experts, 2) if stem == "w13" else (self.num_experts,)
            for name, (shape, dtype) in shapes.items():
                # Scales are held in fp32 while loading (exact for any checkpoint dtype)
                # and narrowed after, see `take`.
                if dtype.is_floating_point and name != "weight":
                    dtype = torch.float32
                param = torch.nn.Parameter(
                    torch.zeros(*lead, *shape, dtype=dtype), requires_grad=False
                )
                param.weight_loader = self._load  # type: ignore[attr-defined]  # vLLM's idiom
                layer.register_parameter(f"{stem}_{name}", param)

    def _load(
        self,
        param: torch.nn.Parameter,
        loaded_weight: torch.Tensor,
        weight_name: str,
        shard_id: str,
        expert_id: int,
        return_success: bool = False,
    ) -> bool | None:
        _, index = PROJECTIONS[shard_id]
        target = param.data[expert_id] if index is None else param.data[expert_id, index]
        if loaded_weight.numel() != target.numel() or (
            loaded_weight.dim() == target.dim() and loaded_weight.shape != target.shape
        ):
            raise SpecExpertUnsupportedError(
                f"{self.layer_name}: checkpoint tensor {weight_name} (expert {expert_id}, "
                f"{shard_id})",
                f"has shape {list(loaded_weight.shape)} where the model's "
                f"config and '{self.format.name}' quantization give {list(target.shape)}",
                "use a checkpoint quantized for this config (or fix its quantization_config)",
            )
        target.copy_(loaded_weight.reshape(target.shape))
        return True if return_success else None

    def take(self, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Remove and return the loaded packed tensors (scales narrowed to the smallest
        float type holding them exactly); the bf16 placeholders are back."""
        tensors = {}
        for stem, shapes in self.shapes.items():
            for name in shapes:
                parameter = layer._parameters.pop(f"{stem}_{name}")
                assert parameter is not None  # (registered by `create`)
                tensor = parameter.data
                if tensor.dtype == torch.float32:
                    tensor = _narrowest(tensor)
                tensors[f"{stem}_{name}"] = tensor
        for name, placeholder in self.placeholders.items():
            layer.register_parameter(name, placeholder)
        return tensors

    def quantize(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Packed tensors of bf16 ``w13_weight [E, 2I, H]``, ``w2_weight [E, H, I]`` in
        vLLM's checkpoint layout (``lowbit``'s copies); biases are kept as they are."""
        tensors: dict[str, list[torch.Tensor]] = {}
        for stem in self.shapes:
            weight = weights[f"{stem}_weight"]
            for expert in range(weight.shape[0]):
                parts = (
                    weight[expert].unflatten(0, (2, -1)) if stem == "w13" else weight[expert, None]
                )
                packed = [self.format.quantize(part) for part in parts]
                for name in self.shapes[stem]:
                    stacked = torch.stack([p[name] for p in packed])
                    tensors.setdefault(f"{stem}_{name}", []).append(
                        stacked if stem == "w13" else stacked[0]
                    )
        result = {name: torch.stack(parts) for name, parts in tensors.items()}
        result.update({name: weights[name].clone() for name in BIASES if name in weights})
        return result

    def requantize(
        self, packed: dict[str, torch.Tensor], target: PackedParameters
    ) -> dict[str, torch.Tensor]:
        """``packed`` re-quantized to ``target``'s format, one expert's bf16 at a time."""
        experts = [
            target.quantize(self.dequantize({name: t[e : e + 1] for name, t in packed.items()}))
            for e in range(self.num_experts)
        ]
        return {name: torch.cat([e[name] for e in experts]) for name in experts[0]}

    def dequantize(self, packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """bf16 ``w13_weight [n, 2I, H]`` and ``w2_weight [n, H, I]`` in vLLM's checkpoint
        layout (before its post-processing); biases pass through."""
        weights = {name: packed[name] for name in BIASES if name in packed}
        for stem, shapes in self.shapes.items():
            parts = {name: packed[f"{stem}_{name}"] for name in shapes}
            out_features, in_features = self.features[stem]
            w = dequantize(self.format, parts, out_features, in_features)
            weights[f"{stem}_weight"] = w.flatten(1, 2) if stem == "w13" else w
        return weights


def dequantize(
    fmt: PackedFormat, parts: dict[str, torch.Tensor], out_features: int, in_features: int
) -> torch.Tensor:
    """The format's dequantize: torch ops on the host, the project's Triton kernel on a
    CUDA device (the same bits; not run on a GPU yet)."""
    if next(iter(parts.values())).is_cuda:
        from vllm_specexpert.triton_kernels.dequantize import dequantize_packed

        return dequantize_packed(fmt, parts, out_features, in_features)
    return fmt.dequantize(parts, out_features, in_features)


def _narrowest(tensor: torch.Tensor) -> torch.Tensor:
    for dtype in (torch.float16, torch.bfloat16):
        narrow = tensor.to(dtype)
        if torch.equal(narrow.float(), tensor):
            return narrow
    return tensor


class PackedDecoder:
    """Packed experts -> slot contents; ``runtime_form``: vLLM's bf16 post-processing."""

    def __init__(
        self,
        parameters: PackedParameters,
        runtime_form: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
        slot_shapes: SlotShapes,
    ):
        self.name = parameters.format.name
        self.parameters = parameters
        self.runtime_form = runtime_form
        self.slot_shapes = slot_shapes

    def __call__(self, packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.runtime_form(self.parameters.dequantize(packed))


LOW_BIT_BITS = 4
"""Bits per weight of ``lowbit``'s copies and of the lookahead draft's experts."""


def low_bit_group(hidden: int, intermediate: int) -> int:
    """The INT4 format's group: 128 input features, or 64 or 32 where 128 does not
    divide both projections' inputs (-1: one group per row)."""
    return next((g for g in (128, 64, 32) if hidden % g == 0 and intermediate % g == 0), -1)


def low_bit_parameters(
    layer_name: str, num_experts: int, hidden: int, intermediate: int
) -> PackedParameters:
    """The INT4 format of ``lowbit``'s copies: asymmetric round-to-nearest in groups of
    :func:`low_bit_group` input features."""
    if hidden % 8 or intermediate % 8:
        raise SpecExpertUnsupportedError(
            f"{layer_name}: INT4 copies of experts of hidden size {hidden} and intermediate "
            f"size {intermediate}",
            "the INT4 format packs eight 4-bit values to a 32-bit word along both sizes",
            "use lookahead and lowbit on a model whose sizes are multiples of 8",
        )
    return PackedParameters(
        PackQuantizedFormat("int4", (), low_bit_group(hidden, intermediate), symmetric=False),
        layer_name,
        num_experts,
        hidden,
        intermediate,
    )


def runtime_form(layer: Any, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """bf16 expert weights in checkpoint layout -> the form vanilla's unquantized method
    leaves them in (its ``_setup_kernel``'s two steps, on a scratch module)."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
        convert_to_unquantized_kernel_format,
    )
    from vllm.model_executor.utils import replace_parameter

    scratch: Any = torch.nn.Module()  # (given the attributes vLLM's format conversion reads)
    for name, tensor in weights.items():
        scratch.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
    scratch.moe_config, scratch.activation = layer.moe_config, layer.activation
    method = layer.quant_method
    w13, w2 = convert_to_unquantized_kernel_format(
        method.unquantized_backend,
        layer.moe_config,
        scratch.w13_weight,
        scratch.w2_weight,
        layer=scratch,
    )
    replace_parameter(scratch, "w13_weight", w13)
    replace_parameter(scratch, "w2_weight", w2)
    method.moe_kernel.fused_experts.process_weights_after_loading(scratch)
    return {name: getattr(scratch, name).data for name in weights}
