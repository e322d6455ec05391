"""The kernel form: experts as the expert kernel reads them, the form an expert pack holds
them in (:mod:`.expert_pack`), so that a read lands where the kernel reads it and
nothing is decoded on arrival (docs/design.md, "The disk tier").

``checkpoint``: the checkpoint's fused layout, cast to the model's dtype (the CUDA
kernel's). ``cpu-prepacked``: vLLM's CPU fused-MoE kernel's (``cpu_fused_moe``): the
intermediate size zero-padded to the kernel's alignment and each expert's matrices
reordered for one ISA (``vec`` or ``amx``; the two orders differ, so a pack made for one
is wrong for the other and is refused, never run). The prepacking of an expert depends on
that expert alone (checked in ``tests/test_expert_pack.py``), so a pack is written one
expert at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from pydantic import BaseModel, PositiveInt

from vllm_specexpert.artifacts import MANIFEST
from vllm_specexpert.tiers.checkpoint_experts import TensorSpec

DtypeName = Literal[
    "bfloat16", "float16", "float32", "int64", "int32", "uint8", "int8", "float8_e4m3fn"
]
DTYPES: dict[DtypeName, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
"""Dtypes a pack's tensors may have, by their name in the manifest."""
DTYPE_NAMES: dict[torch.dtype, DtypeName] = {dtype: name for name, dtype in DTYPES.items()}


class KernelForm(BaseModel):
    """The form of a pack's experts, as its manifest names it."""

    model_config = MANIFEST

    layout: Literal["checkpoint", "cpu-prepacked"]
    dtype: DtypeName
    """The model's dtype (vLLM casts the checkpoint's to it when it loads)."""
    isa: Literal["vec", "amx"] | None = None
    """``cpu-prepacked``: the ISA the kernel's order is for."""
    intermediate_alignment: PositiveInt = 1
    """``cpu-prepacked``: the intermediate size is zero-padded to a multiple of this."""

    def describe(self) -> str:
        if self.layout == "checkpoint":
            return f"the checkpoint's layout in {self.dtype}"
        return f"the CPU kernel's {self.isa} prepacked layout in {self.dtype}"

    def padded(self, intermediate: int) -> int:
        step = self.intermediate_alignment
        return -(-intermediate // step) * step

    def specs(self, specs: Sequence[TensorSpec]) -> list[TensorSpec]:
        """The shapes and dtypes this form gives experts of the checkpoint's ``specs``."""
        dtype = DTYPES[self.dtype]
        out = []
        for name, shape, _ in specs:
            if self.layout == "cpu-prepacked" and name == "w13_weight":
                shape = (2 * self.padded(shape[0] // 2), *shape[1:])
            elif self.layout == "cpu-prepacked" and name == "w2_weight":
                shape = (*shape[:-1], self.padded(shape[-1]))
            out.append((name, tuple(shape), dtype))
        return out

    def __call__(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One expert (the checkpoint's ``w13_weight [2I, H]``, ``w2_weight [H, I]``) in
        this form."""
        out = {name: t.to(DTYPES[self.dtype]).contiguous() for name, t in tensors.items()}
        if self.layout == "checkpoint":
            return out
        from vllm import _custom_ops as ops

        isa = str(self.isa)
        w13, w2 = out["w13_weight"], out["w2_weight"]
        intermediate = w13.shape[0] // 2
        padded = self.padded(intermediate)
        if padded != intermediate:  # as vLLM pads: each half of w13, then w2's columns
            gate_up = w13.new_zeros(2 * padded, w13.shape[1])
            gate_up[:intermediate] = w13[:intermediate]
            gate_up[padded : padded + intermediate] = w13[intermediate:]
            down = w2.new_zeros(w2.shape[0], padded)
            down[:, :intermediate] = w2
            w13, w2 = gate_up, down
        out["w13_weight"] = ops.cpu_prepack_moe_weight(w13[None], isa)[0]
        out["w2_weight"] = ops.cpu_prepack_moe_weight(w2[None], isa)[0]
        return out


def cpu_kernel_form(dtype: torch.dtype, isa: str | None = None) -> KernelForm:
    """The form vLLM's CPU fused-MoE kernel runs unquantized experts of ``dtype`` in on
    this machine (``isa``: for another machine's): AMX where the CPU has its tiles and the
    experts are bf16, else the portable vector kernel (vLLM's own choice; the layer
    checks its real kernel against the pack's form when it loads)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
        CPUUnquantizedExperts,
        X86CPUUnquantizedExperts,
    )

    if isa is None:
        amx = X86CPUUnquantizedExperts._supports_current_device() and dtype == torch.bfloat16
        isa = "amx" if amx else "vec"
    kernel = X86CPUUnquantizedExperts if isa == "amx" else CPUUnquantizedExperts
    return KernelForm(
        layout="cpu-prepacked",
        dtype=DTYPE_NAMES[dtype],
        isa=isa,  # type: ignore[arg-type]  # (checked by the model)
        intermediate_alignment=kernel._intermediate_alignment(),
    )


def model_kernel_form(dtype: torch.dtype, cpu: bool, isa: str | None = None) -> KernelForm:
    """The form a pack of a model run in ``dtype`` is written in: the CPU kernel's on the
    CPU build, else the checkpoint's layout (the CUDA kernel reads it as it is)."""
    if cpu:
        return cpu_kernel_form(dtype, isa)
    return KernelForm(layout="checkpoint", dtype=DTYPE_NAMES[dtype])


__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "KernelForm",
    "cpu_kernel_form",
    "model_kernel_form",
]
