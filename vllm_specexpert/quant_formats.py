"""Quantized expert formats: how a checkpoint holds one projection of one expert, packed,
and how it becomes a bf16 weight again.

A checkpoint's expert is every per-expert tensor it holds (packed weights, scales,
zeros, group indices). The slow tier keeps them as they are and the link moves them
packed; a slot that needs bf16 gets them dequantized on arrival, with one rounding:
``(q - z) * s`` in fp32, rounded to bf16. ``specexpert dequantize`` writes a checkpoint's
bf16 twin with the same function, so an expert computed from its slot and the twin's
expert are the same bits.

Formats (as vLLM reads them from ``quantization_config``):

* ``awq``: ``qweight [in, out/8]`` int32 (AutoAWQ's nibble order), ``qzeros [in/g, out/8]``,
  ``scales [in/g, out]``.
* ``gptq``: ``qweight [in/8, out]`` int32, ``qzeros [in/g, out/8]`` (stored minus one,
  AutoGPTQ's v1 format), ``scales [in/g, out]``; static group order only (vLLM 0.32
  refuses ``desc_act``), so input row ``r`` is in group ``r // g`` and ``g_idx`` is
  not read.
* ``pack-quantized`` (compressed-tensors W4A16): ``weight_packed [out, in/8]`` int32 of
  signed values offset by 8, ``weight_scale [out, in/g]``, ``weight_shape [2]``, and for
  asymmetric schemes ``weight_zero_point [out/8, in/g]``.
* ``fp8`` (weight-only: the activations stay bf16): ``weight [out, in]`` float8_e4m3fn with
  a per-tensor ``weight_scale``, a per-channel ``weight_scale [out, 1]``
  (compressed-tensors), or block scales ``weight_scale_inv [out/bo, in/bi]``.

:func:`vllm_specexpert.quant_config.format_of` reads a Hugging Face
``quantization_config`` into one of these.
"""

from __future__ import annotations

import functools
import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

SUPPORTED_GROUP_SIZES = (32, 64, 128, -1)
"""INT4 group sizes (``-1``: one group per output channel)."""

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AutoAWQ's packing: nibble ``i`` of an int32 holds column ``8 * c + AWQ_ORDER[i]``."""

TensorShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class PackedFormat(ABC):
    """One quantized format (see module doc). Shapes are those of one projection
    ``weight [out_features, in_features]`` of one expert; every function also takes
    leading batch dimensions (experts, projections)."""

    name: str
    """``awq``, ``gptq``, ``pack-quantized`` or ``fp8``."""
    skip: tuple[str, ...] = ()
    """Module-name patterns the checkpoint leaves unquantized (``re:`` = regex, else a
    substring), from ``modules_to_not_convert``/``ignore``/``ignored_layers``."""

    bits: int = field(default=4, init=False)

    @abstractmethod
    def tensor_shapes(self, out_features: int, in_features: int) -> TensorShapes:
        """Checkpoint tensor name -> (shape, dtype) of one projection."""

    @abstractmethod
    def dequantize(
        self, tensors: dict[str, torch.Tensor], out_features: int, in_features: int
    ) -> torch.Tensor:
        """``[..., out, in]`` bf16 weight of packed ``tensors`` (one rounding)."""

    @abstractmethod
    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """Round-to-nearest packed tensors of one ``[out, in]`` weight."""

    @abstractmethod
    def features(self, tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
        """``(out_features, in_features)`` of one projection's packed tensors."""

    def skips(self, module: str) -> bool:
        """Whether the checkpoint leaves ``module`` unquantized."""
        return any(
            re.match(p[3:], module) if p.startswith("re:") else p in module for p in self.skip
        )

    def bytes_per_weight(self, out_features: int, in_features: int) -> int:
        """Bytes one projection occupies packed."""
        return sum(
            math.prod(shape) * dtype.itemsize
            for shape, dtype in self.tensor_shapes(out_features, in_features).values()
        )


# --------------------------------------------------------------------- int4 helpers


def unpack_int4(
    packed: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))
) -> torch.Tensor:
    """Unsigned 4-bit values of int32 ``packed`` along ``dim`` (8 per int32; nibble ``i``
    is value ``order[i]`` of its group of eight)."""
    dim = dim % packed.dim()
    shape = [1] * (packed.dim() + 1)
    shape[dim + 1] = 8
    values = (packed.unsqueeze(dim + 1) >> _shifts(order).view(shape)) & 0xF
    return values.flatten(dim, dim + 1)


@functools.cache
def _shifts(order: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([4 * order.index(j) for j in range(8)], dtype=torch.int32)


def pack_int4(
    values: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))
) -> torch.Tensor:
    """Inverse of :func:`unpack_int4` (values in [0, 15])."""
    dim = dim % values.dim()
    grouped = values.to(torch.int32).unflatten(dim, (-1, 8))
    packed = torch.zeros(grouped.shape[: dim + 1] + grouped.shape[dim + 2 :], dtype=torch.int32)
    for nibble, column in enumerate(order):
        packed |= grouped.select(dim + 1, column) << (4 * nibble)
    return packed


def _groups(in_features: int, group_size: int) -> int:
    return 1 if group_size == -1 else in_features // group_size


def rtn_int4(
    weight: torch.Tensor, group_size: int, symmetric: bool, min_zero: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit codes of ``weight [out, in]`` per input group: unsigned
    codes ``q [out, in]``, zero points ``z [out, groups]`` (at least ``min_zero``) and
    scales ``s [out, groups]`` (``w ~ (q - z) * s``)."""
    out_features, in_features = weight.shape
    size = in_features if group_size == -1 else group_size
    w = weight.float().reshape(out_features, in_features // size, size)
    if symmetric:
        scale = w.abs().amax(dim=-1).clamp(min=1e-8) / 7.0
        zero = torch.full_like(scale, 8.0)
    else:
        low, high = w.amin(dim=-1).clamp(max=0.0), w.amax(dim=-1).clamp(min=0.0)
        scale = ((high - low) / 15.0).clamp(min=1e-8)
        zero = torch.round(-low / scale).clamp(min_zero, 15)
    q = torch.clamp(torch.round(w / scale[..., None]) + zero[..., None], 0, 15)
    return q.reshape(out_features, in_features).to(torch.int32), zero.to(torch.int32), scale


def _dequantize(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, dim: int) -> torch.Tensor:
    """The one rounding: ``(q - z) * s`` in fp32, rounded to bf16. ``zero`` and ``scale``
    hold one value per group of ``q``'s axis ``dim`` (consecutive entries), where ``q``
    has one per entry."""
    dim = dim % q.dim()
    groups = zero.shape[dim]
    # q - z is a small integer: exact in int32 and in fp32 alike.
    w = (q.unflatten(dim, (groups, -1)) - zero.unsqueeze(dim + 1)).float() * scale.unsqueeze(
        dim + 1
    ).float()
    return w.to(torch.bfloat16).flatten(dim, dim + 1)


# -------------------------------------------------------------------------- formats


@dataclass(frozen=True)
class AwqFormat(PackedFormat):
    group_size: int = 128

    def tensor_shapes(self, out_features: int, in_features: int) -> TensorShapes:
        groups = _groups(in_features, self.group_size)
        return {
            "qweight": ((in_features, out_features // 8), torch.int32),
            "qzeros": ((groups, out_features // 8), torch.int32),
            "scales": ((groups, out_features), torch.float16),
        }

    def dequantize(
        self, tensors: dict[str, torch.Tensor], out_features: int, in_features: int
    ) -> torch.Tensor:
        q = unpack_int4(tensors["qweight"], -1, AWQ_ORDER)  # [.., in, out]
        zero = unpack_int4(tensors["qzeros"], -1, AWQ_ORDER)  # [.., g, out]
        return _dequantize(q, zero, tensors["scales"], -2).transpose(-1, -2)

    def features(self, tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
        return tensors["qweight"].shape[-1] * 8, tensors["qweight"].shape[-2]

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, zero, scale = rtn_int4(weight, self.group_size, symmetric=False)
        return {
            "qweight": pack_int4(q.T, -1, AWQ_ORDER),
            "qzeros": pack_int4(zero.T, -1, AWQ_ORDER),
            "scales": scale.T.to(torch.float16).contiguous(),
        }


@dataclass(frozen=True)
class GptqFormat(PackedFormat):
    group_size: int = 128
    symmetric: bool = True

    def tensor_shapes(self, out_features: int, in_features: int) -> TensorShapes:
        groups = _groups(in_features, self.group_size)
        return {
            "qweight": ((in_features // 8, out_features), torch.int32),
            "qzeros": ((groups, out_features // 8), torch.int32),
            "scales": ((groups, out_features), torch.float16),
        }

    def dequantize(
        self, tensors: dict[str, torch.Tensor], out_features: int, in_features: int
    ) -> torch.Tensor:
        q = unpack_int4(tensors["qweight"], -2)  # [.., in, out]
        zero = unpack_int4(tensors["qzeros"], -1) + 1  # v1: stored z - 1
        return _dequantize(q, zero, tensors["scales"], -2).transpose(-1, -2)

    def features(self, tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
        return tensors["qweight"].shape[-1], tensors["qweight"].shape[-2] * 8

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        # v1 stores z - 1 in four bits: a zero point of 0 cannot be stored.
        q, zero, scale = rtn_int4(weight, self.group_size, self.symmetric, min_zero=1)
        in_features = weight.shape[1]
        size = in_features if self.group_size == -1 else self.group_size
        return {
            "qweight": pack_int4(q.T, -2),
            "qzeros": pack_int4(zero.T - 1, -1),
            "scales": scale.T.to(torch.float16).contiguous(),
            "g_idx": (torch.arange(in_features) // size).to(torch.int32),
        }


@dataclass(frozen=True)
class PackQuantizedFormat(PackedFormat):
    """compressed-tensors ``pack-quantized`` W4A16."""

    group_size: int = 128
    symmetric: bool = True

    def tensor_shapes(self, out_features: int, in_features: int) -> TensorShapes:
        groups = _groups(in_features, self.group_size)
        shapes: TensorShapes = {
            "weight_packed": ((out_features, in_features // 8), torch.int32),
            "weight_scale": ((out_features, groups), torch.bfloat16),
            "weight_shape": ((2,), torch.int64),
        }
        if not self.symmetric:
            shapes["weight_zero_point"] = ((out_features // 8, groups), torch.int32)
        return shapes

    def dequantize(
        self, tensors: dict[str, torch.Tensor], out_features: int, in_features: int
    ) -> torch.Tensor:
        q = unpack_int4(tensors["weight_packed"], -1)  # [.., out, in]
        scale = tensors["weight_scale"]
        if self.symmetric:
            zero = torch.full_like(scale, 8, dtype=torch.int32)
        else:  # signed zero points, offset like the weights
            zero = unpack_int4(tensors["weight_zero_point"], -2)
        return _dequantize(q, zero, scale, -1)

    def features(self, tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
        out_features, in_features = tensors["weight_shape"].reshape(-1, 2)[0].tolist()
        return int(out_features), int(in_features)

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, zero, scale = rtn_int4(weight, self.group_size, self.symmetric)
        tensors = {
            "weight_packed": pack_int4(q, -1),
            "weight_scale": scale.to(torch.bfloat16),
            "weight_shape": torch.tensor(weight.shape, dtype=torch.int64),
        }
        if not self.symmetric:
            tensors["weight_zero_point"] = pack_int4(zero, -2)
        return tensors


FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


@dataclass(frozen=True)
class Fp8Format(PackedFormat):
    """Weight-only FP8 (e4m3) with per-tensor, per-channel or block scales."""

    scales: str = "tensor"
    """``tensor``, ``channel`` or ``block``."""
    block: tuple[int, int] = (128, 128)
    """Block shape ``[out, in]`` (``scales == "block"``)."""

    bits: int = field(default=8, init=False)

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.scales == "block" else "weight_scale"

    def _scale_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        if self.scales == "block":
            return (math.ceil(out_features / self.block[0]), math.ceil(in_features / self.block[1]))
        return (out_features, 1) if self.scales == "channel" else ()

    def tensor_shapes(self, out_features: int, in_features: int) -> TensorShapes:
        return {
            "weight": ((out_features, in_features), torch.float8_e4m3fn),
            self.scale_name: (self._scale_shape(out_features, in_features), torch.float32),
        }

    def _expand(self, scale: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        if self.scales == "block":
            scale = scale.repeat_interleave(self.block[0], dim=-2)[..., :out_features, :]
            return scale.repeat_interleave(self.block[1], dim=-1)[..., :in_features]
        return scale if self.scales == "channel" else scale[..., None, None]

    def dequantize(
        self, tensors: dict[str, torch.Tensor], out_features: int, in_features: int
    ) -> torch.Tensor:
        scale = self._expand(tensors[self.scale_name].float(), out_features, in_features)
        return (tensors["weight"].float() * scale).to(torch.bfloat16)

    def features(self, tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
        return tensors["weight"].shape[-2], tensors["weight"].shape[-1]

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        out_features, in_features = weight.shape
        w = weight.float()
        if self.scales == "block":
            bo, bi = self.block
            padded = torch.zeros(
                math.ceil(out_features / bo) * bo, math.ceil(in_features / bi) * bi
            )
            padded[:out_features, :in_features] = w.abs()
            amax = padded.unflatten(0, (-1, bo)).unflatten(2, (-1, bi)).amax(dim=(1, 3))
        elif self.scales == "channel":
            amax = w.abs().amax(dim=1, keepdim=True)
        else:
            amax = w.abs().amax()
        scale = amax.clamp(min=1e-12) / FP8_MAX
        q = (w / self._expand(scale, out_features, in_features)).clamp(-FP8_MAX, FP8_MAX)
        return {"weight": q.to(torch.float8_e4m3fn), self.scale_name: scale.float()}
