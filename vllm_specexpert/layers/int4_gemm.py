"""INT4 experts in the form vLLM's CPU W4A16 GEMM reads (``cpu_gemm_wna16``), and fused
experts computed on that form with no bf16 copy: the ``lookahead`` draft's under the disk
tier on the CPU build. Decoding an INT4 expert into a bf16 slot costs 15-265 ms here,
computing it packed 1.2-3.2x a bf16 expert's time (``benchmarks/int4_kernel.py``).

The form of a projection ``[N out, K in]``: ``qweight [N/16, 2K]`` int32 (codes packed 8
to a word along the outputs, each block of 16 outputs contiguous), ``scales [K/g, N]`` in
the model's dtype and ``qzeros [K/g, N/8]`` int32, for ``w = (q - z) * s``: ``lowbit``'s
rounding and groups (:func:`~vllm_specexpert.layers.packed_experts.low_bit_group`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from vllm.platforms import current_platform

from vllm_specexpert.layers.packed_experts import BIASES, low_bit_group
from vllm_specexpert.quant_formats import pack_int4, rtn_int4

GEMM_DTYPES = (torch.bfloat16, torch.float16)
"""Activation dtypes the GEMM has (not fp32)."""
ALIGN = 32
"""The GEMM's input and output sizes are multiples of this."""
BLOCK = 16
"""Output channels per block of ``qweight``."""
PROJECTIONS = ("qweight", "scales", "qzeros")


def gemm_built() -> bool:
    """This vLLM build has the W4A16 GEMM: its CPU build for AVX-512 has, its build for
    AVX2 has not (``torch.ops._C`` lacks ``cpu_gemm_wna16``)."""
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

    return current_platform.is_cpu() and hasattr(torch.ops._C, "cpu_gemm_wna16")


def runs_packed(dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """This build computes INT4 experts of these sizes in ``dtype`` packed."""
    return (
        gemm_built() and dtype in GEMM_DTYPES and hidden % ALIGN == 0 and intermediate % ALIGN == 0
    )


def projection_form(
    weight: torch.Tensor, group: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``weight [N, K]`` rounded to INT4 in groups of ``group`` inputs, in the GEMM's form."""
    n, k = weight.shape
    codes, zeros, scales = rtn_int4(weight, group, symmetric=False)  # [N, K], [N, G], [N, G]
    packed = pack_int4(codes.t(), 1)  # [K, N/8]
    blocks = packed.view(k, n // BLOCK, BLOCK // 8).permute(1, 0, 2).reshape(n // BLOCK, -1)
    return {
        "qweight": blocks.contiguous(),
        "scales": scales.t().to(dtype).contiguous(),
        "qzeros": pack_int4(zeros.t(), 1).contiguous(),
    }


def expert_form(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One expert (the checkpoint's ``w13_weight [2I, H]``, ``w2_weight [H, I]``, biases)
    in the GEMM's form: ``w13_qweight``, ``w13_scales``, ... and the biases in ``dtype``."""
    w13, w2 = tensors["w13_weight"], tensors["w2_weight"]
    group = low_bit_group(w13.shape[1], w2.shape[1])
    out = {}
    for stem, weight in (("w13", w13), ("w2", w2)):
        for part, tensor in projection_form(weight, group, dtype).items():
            out[f"{stem}_{part}"] = tensor
    out.update({name: tensors[name].to(dtype).contiguous() for name in BIASES if name in tensors})
    return out


class Int4GemmExperts:
    """A layer's fused experts on INT4 experts in the GEMM's form: one GEMM pair per
    distinct expert, vLLM's activation op between, fp32 sums over the top-k. It is the
    layer's kernel in :class:`~vllm_specexpert.layers.slot_kernel.SlotKernel`'s place:
    on slot indices (the CPU build's), on slots or the host store alike."""

    pool_reach = None
    """(no addressing limit: each expert's tensors are passed on their own)"""

    def __init__(self, activation: Any) -> None:
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.fused_moe.activation import (
            MoEActivation,
            apply_moe_activation,
        )

        self.activation = MoEActivation(getattr(activation, "value", activation))
        self.isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
        # (resolved once: __call__ runs per layer call)
        self._gemm, self._activate = ops.cpu_gemm_wna16, apply_moe_activation

    def direct_experts(self) -> None:
        """(not vLLM's CPU experts object)"""
        return None

    def host_kernel(self) -> Int4GemmExperts:
        """The host store holds the slots' form: the same kernel runs there."""
        return self

    def __call__(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        ids: torch.Tensor,
        tensors: dict[str, torch.Tensor],
        expert_map: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
        tile_tokens: int = 0,
    ) -> torch.Tensor:
        """(``out`` is not written: its sum is fp32 first, the adapter copies the result;
        ``tile_tokens``: no tiles)"""
        assert expert_map is None  # (the CPU build's kernels run on slot indices)
        isa = self.isa if x.dtype == torch.bfloat16 else "vec"  # (AMX: bf16 only)
        total = torch.zeros(x.shape, dtype=torch.float32)
        for expert in torch.unique(ids).tolist():
            rows, ks = (ids == expert).nonzero(as_tuple=True)
            h = x[rows]
            for stem in ("w13", "w2"):
                qweight, scales, qzeros = (tensors[f"{stem}_{p}"][expert] for p in PROJECTIONS)
                bias = tensors[f"{stem}_bias"][expert] if f"{stem}_bias" in tensors else None
                h = self._gemm(h, qweight, scales, qzeros, bias, 8, isa)
                if stem == "w13":
                    width = h.shape[1] // 2 if self.activation.is_gated else h.shape[1]
                    h = self._activate(self.activation, h.new_empty(h.shape[0], width), h)
            total.index_add_(0, rows, h.float() * topk_weights[rows, ks, None].float())
        return total.to(x.dtype)
