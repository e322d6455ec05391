"""Quantized experts dequantized on the device: the CUDA side of
:meth:`~vllm_specexpert.quant_formats.PackedFormat.dequantize`.

:func:`dequantize_packed` turns one projection's packed checkpoint tensors (any leading
batch dimensions: experts, projections) into the same bf16 ``[..., out, in]`` weight as
the format's own ``dequantize``, bit for bit: ``(q - z) * s`` (FP8: ``w * s``) in fp32,
rounded once to bf16. Every program writes one ``[BLOCK_O, BLOCK_I]`` tile of one
weight; each element reads its own int32 word, nibble, zero point and scale. Neighbours
read the same word from the same cache line, so the packed tensors should cross DRAM
about once and writing the bf16 weight (4x the packed INT4 bytes) bound the kernel; not
measured.

* :func:`dequantize_int4_kernel`: AWQ, GPTQ and pack-quantized, told apart by constexprs
  (which dimension the codes are packed along, AutoAWQ's nibble order, stored or fixed
  zero points). Zero points are packed along the output dimension in all three.
* :func:`dequantize_fp8_kernel`: e4m3 weights with one scale per ``[block_o, block_i]``
  block (per-tensor and per-channel scales are blocks that cover the weight or a row).

Both round to bf16 and decode e4m3 in integer arithmetic (see :func:`_bf16` and
:func:`_e4m3`), so the bits do not depend on the backend's conversions. Tested under
``TRITON_INTERPRET=1`` against the torch reference and compiled ahead of time for sm_80
and sm_90 (``tests/``); it has NOT run on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_specexpert.quant_formats import (
    AWQ_ORDER,
    AwqFormat,
    Fp8Format,
    GptqFormat,
    PackedFormat,
    PackQuantizedFormat,
)

# _nibble's AutoAWQ branch is this permutation written as arithmetic.
assert all(AWQ_ORDER[(j % 2) * 4 + j // 2] == j for j in range(8)), AWQ_ORDER


@triton.jit
def _nibble(word, index, AWQ: tl.constexpr):
    """Value ``index`` (0-7) of the eight 4-bit values packed in int32 ``word``."""
    if AWQ:
        index = (index % 2) * 4 + index // 2
    # An arithmetic shift of a negative word brings ones in from the top; the mask drops them.
    return (word >> (index * 4)) & 0xF


@triton.jit
def _bf16(x):
    """fp32 -> bf16, round to nearest even, as torch's CPU conversion does it. Written out
    because the interpreter truncates in ``x.to(tl.bfloat16)``; on a GPU it is the same
    as ``cvt.rn.bf16.f32``. A NaN stays a NaN (adding the bias to one could carry into the
    sign bit)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)  # x != x: NaN
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _e4m3(byte):
    """float8_e4m3fn bits (int32) -> fp32. Triton refuses ``fp8e4nv`` before sm_89 (vLLM
    runs FP8 weight-only checkpoints on sm_80), so the bits go into an fp16: sign to bit 15,
    exponent and mantissa to bits 7-14 make the same number times 2^-8 (exponent bias 15
    instead of 7), subnormals included, and both conversions are exact."""
    half = (((byte & 0x80) << 8) | ((byte & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
    value = half.to(tl.float32) * 256.0
    return tl.where((byte & 0x7F) == 0x7F, float("nan"), value)  # e4m3fn has NaN, no inf


@triton.jit
def dequantize_int4_kernel(
    q_ptr,
    stride_qb,
    stride_qo,
    stride_qi,  # int32 codes, 8 per word along o or i
    z_ptr,
    stride_zb,
    stride_zo,
    stride_zg,  # int32 zero points, 8 per word along o
    s_ptr,
    stride_sb,
    stride_so,
    stride_sg,  # scales [out, groups] (any float dtype)
    out_ptr,  # bf16 [B, out, in], contiguous
    out_features,
    in_features,
    group,  # group: input rows per group
    PACKED_IN: tl.constexpr,  # codes packed along in (gptq, pack-quantized)
    AWQ: tl.constexpr,  # AutoAWQ's nibble order (codes and zeros)
    HAS_ZERO: tl.constexpr,  # zero points stored, else ZERO_BIAS alone
    ZERO_BIAS: tl.constexpr,  # added to a stored zero (gptq v1: 1)
    BLOCK_O: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    # Batch offsets in int64 (B * out * in can pass 2^31), offsets within one weight in int32.
    b = tl.program_id(2).to(tl.int64)
    q_ptr += b * stride_qb
    z_ptr += b * stride_zb
    s_ptr += b * stride_sb
    out_ptr += b * out_features * in_features
    o = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)[:, None]
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)[None, :]
    mask = (o < out_features) & (i < in_features)
    g = i // group
    if PACKED_IN:
        word = tl.load(q_ptr + o * stride_qo + (i // 8) * stride_qi, mask=mask)
        q = _nibble(word, i % 8, AWQ)
    else:
        word = tl.load(q_ptr + (o // 8) * stride_qo + i * stride_qi, mask=mask)
        q = _nibble(word, o % 8, AWQ)
    if HAS_ZERO:
        word = tl.load(z_ptr + (o // 8) * stride_zo + g * stride_zg, mask=mask)
        zero = _nibble(word, o % 8, AWQ) + ZERO_BIAS
    else:
        zero = ZERO_BIAS
    scale = tl.load(s_ptr + o * stride_so + g * stride_sg, mask=mask)
    w = (q.to(tl.float32) - zero) * scale.to(tl.float32)  # q - z is exact in fp32
    tl.store(out_ptr + o * in_features + i, _bf16(w), mask=mask)


@triton.jit
def dequantize_fp8_kernel(
    w_ptr,
    stride_wb,
    stride_wo,
    stride_wi,  # e4m3fn weight [B, out, in] as uint8
    s_ptr,
    stride_sb,
    stride_so,
    stride_si,  # fp32 scale of each [block_o, block_i] block
    out_ptr,  # bf16 [B, out, in], contiguous
    out_features,
    in_features,
    block_o,
    block_i,
    BLOCK_O: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    b = tl.program_id(2).to(tl.int64)
    w_ptr += b * stride_wb
    s_ptr += b * stride_sb
    out_ptr += b * out_features * in_features
    o = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)[:, None]
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)[None, :]
    mask = (o < out_features) & (i < in_features)
    byte = tl.load(w_ptr + o * stride_wo + i * stride_wi, mask=mask)
    scale = tl.load(s_ptr + (o // block_o) * stride_so + (i // block_i) * stride_si, mask=mask)
    w = _e4m3(byte.to(tl.int32)) * scale.to(tl.float32)
    tl.store(out_ptr + o * in_features + i, _bf16(w), mask=mask)


BLOCK_O, BLOCK_I = 32, 64
"""Output tile of a program: 2048 elements, 16 per thread with 4 warps, a row of 128
bytes of bf16 per store."""


def _batched(tensor: torch.Tensor, transposed: bool = False) -> list:
    """``tensor [..., a, b]`` as ``[B, a, b]``, then its strides along the batch, the output
    and the input dimension (``transposed``: ``a`` runs along the input). A dimension of
    size one gets stride 0: a scale shared by a whole row or weight."""
    tensor = tensor.reshape(-1, *tensor.shape[-2:])
    strides = [s if n > 1 else 0 for s, n in zip(tensor.stride(), tensor.shape, strict=True)]
    # The kernels offset within one weight in int32.
    assert sum((n - 1) * s for n, s in zip(tensor.shape[1:], strides[1:], strict=True)) < 2**31
    return [tensor, strides[0], *((strides[2], strides[1]) if transposed else strides[1:])]


def _int4_layout(fmt: PackedFormat) -> tuple[str, str | None, str, dict]:
    """Codes, zero points (``None``: fixed) and scales of an INT4 format, and the
    kernel's constexprs for it."""
    if isinstance(fmt, AwqFormat):  # qweight [in, out/8], qzeros [g, out/8], scales [g, out]
        return "qweight", "qzeros", "scales", {"PACKED_IN": False, "AWQ": True, "ZERO_BIAS": 0}
    if isinstance(fmt, GptqFormat):  # qweight [in/8, out]; zeros stored minus one
        return "qweight", "qzeros", "scales", {"PACKED_IN": True, "AWQ": False, "ZERO_BIAS": 1}
    if isinstance(fmt, PackQuantizedFormat):  # [out, in/8]; zeros [out/8, g], or 8 (offset)
        zeros = None if fmt.symmetric else "weight_zero_point"
        return (
            "weight_packed",
            zeros,
            "weight_scale",
            {"PACKED_IN": True, "AWQ": False, "ZERO_BIAS": 8 if fmt.symmetric else 0},
        )
    raise NotImplementedError(f"no dequantize kernel for {type(fmt).__name__}")


def dequantize_packed(
    fmt: PackedFormat, tensors: dict[str, torch.Tensor], out_features: int, in_features: int
) -> torch.Tensor:
    """``fmt.dequantize(tensors, out_features, in_features)`` on the tensors' device: the
    bf16 ``[..., out, in]`` weight (contiguous) of one projection's packed tensors, with
    their leading batch dimensions; the same bits."""
    for name, (shape, _) in fmt.tensor_shapes(out_features, in_features).items():
        given = tuple(tensors[name].shape) if name in tensors else shape
        assert given[len(given) - len(shape) :] == shape, (name, given, shape)
    if isinstance(fmt, Fp8Format):
        first = tensors["weight"]
    else:
        codes, zeros, scales, constexprs = _int4_layout(fmt)
        first = tensors[codes]
    out = torch.empty(
        *first.shape[:-2], out_features, in_features, dtype=torch.bfloat16, device=first.device
    )
    if out.numel() == 0:
        return out
    count = out.numel() // (out_features * in_features)
    assert count < 65536, "grid axis 2 holds at most 65535 weights per launch"
    grid = (triton.cdiv(out_features, BLOCK_O), triton.cdiv(in_features, BLOCK_I), count)
    if isinstance(fmt, Fp8Format):
        # Per-tensor ([]) and per-channel ([out, 1]) scales are blocks of one weight or row.
        scale = tensors[fmt.scale_name]
        scale = scale.reshape(*scale.shape, 1, 1) if fmt.scales == "tensor" else scale
        block = fmt.block if fmt.scales == "block" else (1, 1)
        dequantize_fp8_kernel[grid](
            *_batched(tensors["weight"].view(torch.uint8)),
            *_batched(scale),
            out,
            out_features,
            in_features,
            *block,
            BLOCK_O=BLOCK_O,
            BLOCK_I=BLOCK_I,
        )
        return out
    transposed = not isinstance(fmt, PackQuantizedFormat)  # awq, gptq: [in-like, out-like]
    q = _batched(tensors[codes], transposed)
    s = _batched(tensors[scales], transposed)
    # Without stored zero points the pointer is never read (HAS_ZERO=False prunes it).
    z = _batched(tensors[zeros], transposed) if zeros else [s[0], 0, 0, 0]
    group = in_features // tensors[scales].shape[-2 if transposed else -1]
    dequantize_int4_kernel[grid](
        *q,
        *z,
        *s,
        out,
        out_features,
        in_features,
        group,
        HAS_ZERO=zeros is not None,
        **constexprs,
        BLOCK_O=BLOCK_O,
        BLOCK_I=BLOCK_I,
    )
    return out
