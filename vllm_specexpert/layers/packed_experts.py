"""A quantized checkpoint's routed experts, kept packed (see :mod:`vllm_specexpert.quant_formats`).

vLLM's quantized MoE methods cannot run here (every x86 CPU kernel needs AMX) and would
keep every expert on the device anyway. The offloaded layer instead runs vLLM's
unquantized method on one expert's worth of bf16 parameters (so that vLLM sets up its
kernel as for a bf16 model) and registers the checkpoint's tensors as packed parameters
of all experts, ``w13_<name> [E, 2, ...]`` (gate, up) and ``w2_<name> [E, ...]``, filled
by their own weight loader. After loading they go to the slow tier; a
:class:`PackedDecoder` turns the experts a transfer moves into slot contents: the
format's dequantize, then the same post-processing vLLM's unquantized method gives bf16
weights (on the CPU build: the kernel's prepacked layout).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_specexpert.config import SpecExpertUnsupportedError
from vllm_specexpert.quant_formats import PackedFormat
from vllm_specexpert.tiers.store import SlotShapes

PROJECTIONS = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}
"""vLLM shard id -> (parameter stem, index in the stem's projection axis)."""


class PackedParameters:
    """Creates, loads and hands over one layer's packed expert parameters."""

    def __init__(self, fmt: PackedFormat, layer_name: str, num_experts: int, hidden: int,
                 intermediate: int):
        self.format = fmt
        self.layer_name = layer_name
        self.shapes = {"w13": fmt.tensor_shapes(intermediate, hidden),
                       "w2": fmt.tensor_shapes(hidden, intermediate)}
        self.features = {"w13": (intermediate, hidden), "w2": (hidden, intermediate)}
        self.num_experts = num_experts

    def create(self, layer: torch.nn.Module) -> None:
        """Register ``w13_<name>``/``w2_<name>`` on ``layer`` (host memory), in place of
        the one-expert bf16 ``w13_weight``/``w2_weight`` (an FP8 checkpoint's packed
        tensor has that name too); :meth:`take` puts those back."""
        self.placeholders = {name: layer._parameters.pop(name)
                             for name in ("w13_weight", "w2_weight")}
        for stem, shapes in self.shapes.items():
            lead = (self.num_experts, 2) if stem == "w13" else (self.num_experts,)
            for name, (shape, dtype) in shapes.items():
                # Scales are held in fp32 while loading (exact for any checkpoint dtype)
                # and narrowed after, see `tensors`.
                if dtype.is_floating_point and name != "weight":
                    dtype = torch.float32
                param = torch.nn.Parameter(torch.zeros(*lead, *shape, dtype=dtype),
                                           requires_grad=False)
                param.weight_loader = self._load
                layer.register_parameter(f"{stem}_{name}", param)

    def _load(self, param: torch.nn.Parameter, loaded_weight: torch.Tensor, weight_name: str,
              shard_id: str, expert_id: int, return_success: bool = False) -> bool | None:
        stem, index = PROJECTIONS[shard_id]
        target = param.data[expert_id] if index is None else param.data[expert_id, index]
        if loaded_weight.numel() != target.numel() or (
                loaded_weight.dim() == target.dim() and loaded_weight.shape != target.shape):
            raise SpecExpertUnsupportedError(
                f"{self.layer_name}: checkpoint tensor {weight_name} (expert {expert_id}, "
                f"{shard_id})", f"has shape {list(loaded_weight.shape)} where the model's "
                f"config and '{self.format.name}' quantization give {list(target.shape)}",
                "use a checkpoint quantized for this config (or fix its quantization_config)")
        target.copy_(loaded_weight.reshape(target.shape))
        return True if return_success else None

    def take(self, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Remove the loaded packed tensors from ``layer`` and return them, scales
        narrowed to the smallest float type that holds them exactly (what the
        checkpoint had, as far as bytes go); the bf16 placeholders are back."""
        tensors = {}
        for stem, shapes in self.shapes.items():
            for name in shapes:
                tensor = layer._parameters.pop(f"{stem}_{name}").data
                if tensor.dtype == torch.float32:
                    tensor = _narrowest(tensor)
                tensors[f"{stem}_{name}"] = tensor
        for name, placeholder in self.placeholders.items():
            layer.register_parameter(name, placeholder)
        return tensors

    def dequantize(self, packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """bf16 ``w13_weight [n, 2I, H]`` and ``w2_weight [n, H, I]`` in vLLM's checkpoint
        layout (before its post-processing)."""
        weights = {}
        for stem, shapes in self.shapes.items():
            parts = {name: packed[f"{stem}_{name}"] for name in shapes}
            out_features, in_features = self.features[stem]
            w = self.format.dequantize(parts, out_features, in_features)
            weights[f"{stem}_weight"] = w.flatten(1, 2) if stem == "w13" else w
        return weights


def _narrowest(tensor: torch.Tensor) -> torch.Tensor:
    for dtype in (torch.float16, torch.bfloat16):
        narrow = tensor.to(dtype)
        if torch.equal(narrow.float(), tensor):
            return narrow
    return tensor


class PackedDecoder:
    """Packed experts -> slot contents (see module doc). ``runtime_form`` is vLLM's
    post-processing of bf16 expert weights, given by the layer."""

    def __init__(self, parameters: PackedParameters,
                 runtime_form: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                 slot_shapes: SlotShapes):
        self.name = parameters.format.name
        self.parameters = parameters
        self.runtime_form = runtime_form
        self.slot_shapes = slot_shapes

    def __call__(self, packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.runtime_form(self.parameters.dequantize(packed))
