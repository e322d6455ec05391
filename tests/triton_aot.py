"""Ahead-of-time compilation of the plugin's kernels for NVIDIA targets, without a GPU.

``triton.compile`` with a ``GPUTarget`` lowers a kernel to PTX and runs the ``ptxas``
shipped in the Triton wheel, so a machine without a GPU can check that every kernel
compiles for the architectures it is meant for (sm_80: A100/RTX 30xx, sm_90: H100).
:data:`SPECIALIZATIONS` lists, per kernel, the argument types and constexprs of the
launches the runtime makes (bf16 weights; the routing shapes of Qwen3-30B-A3B,
DeepSeek-V2-Lite and Mixtral; AWQ and block-FP8 experts dequantized).
:func:`resource_usage` reads a cubin's registers and stack with the wheel's ``cuobjdump``
(a non-zero stack means the kernel spills).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vllm_specexpert.triton_kernels import dequantize, estimate
from vllm_specexpert.triton_kernels.predict import block_h, predict_routing_kernel
from vllm_specexpert.triton_kernels.slots import (
    copy_experts_kernel,
    update_slot_map_kernel,
)

ARCHITECTURES = (80, 90)
"""Compute capabilities every kernel is compiled for in the tests."""


@dataclass
class Specialization:
    """One launch configuration of a kernel."""

    name: str
    kernel: object
    types: dict[str, str]
    """Runtime argument -> Triton type (``*bf16``, ``i32``, ``fp32``, ...)."""
    constexprs: dict[str, object] = field(default_factory=dict)

    def source(self) -> ASTSource:
        signature = {}
        for arg in self.kernel.arg_names:
            if arg in self.constexprs:
                signature[arg] = "constexpr"
            else:
                signature[arg] = self.types[arg]
        return ASTSource(self.kernel, signature, self.constexprs)


def _predict(
    name: str, quasi_hidden: bool, top_k: int, experts: int, hidden: int
) -> Specialization:
    return Specialization(
        name=name,
        kernel=predict_routing_kernel,
        types={
            "s_ptr": "*bf16",
            "stride_s": "i64",
            "ids_ptr": "*i32",
            "weights_ptr": "*fp32",
            "stride_k": "i64",
            "vectors_ptr": "*fp32",
            "scale_ptr": "*fp32",
            "norm_ptr": "*bf16",
            "gate_ptr": "*bf16",
            "stride_gate": "i64",
            "out_ids_ptr": "*i32",
            "out_weights_ptr": "*fp32",
            "H": "i32",
            "E": "i32",
            "eps": "fp32",
        },
        constexprs={
            "K": top_k if quasi_hidden else 0,
            "TOPK": top_k,
            "TOPK_PAD": triton.next_power_of_2(top_k),
            "BLOCK_E": triton.next_power_of_2(experts),
            "BLOCK_H": block_h(experts, hidden),
            "QUASI_HIDDEN": quasi_hidden,
            "RENORMALIZE": True,
        },
    )


def _estimate(
    name: str, top_k: int, experts: int, hidden: int, latent: int = 128, inner: int = 256
) -> Specialization:
    return Specialization(
        name=name,
        kernel=estimate.estimate_routing_kernel,
        types={
            "q_ptr": "*bf16",
            "stride_q": "i64",
            **{
                f"{p}_ptr": "*fp32"
                for p in (
                    "proj_w",
                    "proj_b",
                    "embedding",
                    "up_w",
                    "up_b",
                    "down_w",
                    "down_b",
                    "norm_w",
                    "norm_b",
                    "head_w",
                    "head_b",
                    "scratch",
                    "out_weights",
                )
            },
            "out_ids_ptr": "*i32",
            "H": "i32",
            "M": "i32",
            "E": "i32",
            "eps": "fp32",
        },
        constexprs={
            "D": latent,
            "TOPK": top_k,
            "TOPK_PAD": triton.next_power_of_2(top_k),
            "BLOCK_E": triton.next_power_of_2(experts),
            "RENORMALIZE": True,
            **estimate.blocks(latent, inner, hidden, experts),
        },
    )


SPECIALIZATIONS: list[Specialization] = [
    _estimate("estimate_e128_k8", 8, 128, 2048),  # Qwen3-30B-A3B
    _estimate("estimate_e64_k6", 6, 64, 2048),  # DeepSeek-V2-Lite
    _predict("predict_quasi_hidden_e128_k8", True, 8, 128, 2048),  # Qwen3-30B-A3B
    _predict("predict_router_e128_k8", False, 8, 128, 2048),
    _predict("predict_quasi_hidden_e64_k6", True, 6, 64, 2048),  # DeepSeek-V2-Lite
    _predict("predict_quasi_hidden_e8_k2", True, 2, 8, 4096),  # Mixtral-8x7B
    Specialization(
        name="update_slot_map",
        kernel=update_slot_map_kernel,
        types={"map_ptr": "*i32", "experts_ptr": "*i32", "slots_ptr": "*i32", "n": "i32"},
        constexprs={"BLOCK": 128},
    ),
    Specialization(
        name="copy_experts_bf16",
        kernel=copy_experts_kernel,
        types={
            "src0_ptr": "*bf16",
            "dst0_ptr": "*bf16",
            "row0": "i64",
            "src1_ptr": "*bf16",
            "dst1_ptr": "*bf16",
            "row1": "i64",
            "experts_ptr": "*i32",
            "slots_ptr": "*i32",
            "blocks0": "i32",
        },
        constexprs={"BLOCK": 4096},
    ),
    Specialization(
        name="dequantize_int4_awq",
        kernel=dequantize.dequantize_int4_kernel,
        types={
            "q_ptr": "*i32",
            "stride_qb": "i32",
            "stride_qo": "i32",
            "stride_qi": "i32",
            "z_ptr": "*i32",
            "stride_zb": "i32",
            "stride_zo": "i32",
            "stride_zg": "i32",
            "s_ptr": "*fp16",
            "stride_sb": "i32",
            "stride_so": "i32",
            "stride_sg": "i32",
            "out_ptr": "*bf16",
            "out_features": "i32",
            "in_features": "i32",
            "group": "i32",
        },
        constexprs={
            "PACKED_IN": False,
            "AWQ": True,
            "HAS_ZERO": True,
            "ZERO_BIAS": 0,
            "BLOCK_O": dequantize.BLOCK_O,
            "BLOCK_I": dequantize.BLOCK_I,
        },
    ),
    Specialization(
        name="dequantize_fp8_block",
        kernel=dequantize.dequantize_fp8_kernel,
        types={
            "w_ptr": "*u8",
            "stride_wb": "i32",
            "stride_wo": "i32",
            "stride_wi": "i32",
            "s_ptr": "*fp32",
            "stride_sb": "i32",
            "stride_so": "i32",
            "stride_si": "i32",
            "out_ptr": "*bf16",
            "out_features": "i32",
            "in_features": "i32",
            "block_o": "i32",
            "block_i": "i32",
        },
        constexprs={"BLOCK_O": dequantize.BLOCK_O, "BLOCK_I": dequantize.BLOCK_I},
    ),
]


def compile_for(specialization: Specialization, arch: int):
    """Compile for ``sm_{arch}``; returns Triton's ``CompiledKernel`` (``.asm`` holds
    ``ptx`` and ``cubin``)."""
    return triton.compile(specialization.source(), target=GPUTarget("cuda", arch, 32))


def resource_usage(compiled) -> dict[str, int]:
    """``{"REG": registers per thread, "STACK": bytes, "LOCAL": bytes, ...}`` of a compiled
    kernel's cubin, from ``cuobjdump -res-usage`` (shipped in the Triton wheel)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run(
            [tool, "-res-usage", cubin.name], capture_output=True, text=True, check=True
        ).stdout
    line = next(line for line in report.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in re.findall(r"(\w+):(\d+)", line)}
