"""The expert pack's form checked against the kernel a layer really runs, when the layer
loads: a pack made for another ISA, dtype or vLLM build is refused naming ``disk.path``,
never run (docs/design.md, "The disk tier").

The pack's manifest names its form (:mod:`vllm_specexpert.tiers.kernel_form`), chosen
before any worker started. The proof is the layer's own: the first layer checked turns
one expert read from the checkpoint into vLLM's runtime form and compares its bytes with
the pack's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.layers.packed_experts import runtime_form
from vllm_specexpert.tiers.checkpoint_experts import CheckpointExperts
from vllm_specexpert.tiers.expert_pack import FIELD
from vllm_specexpert.tiers.pack_experts import PackExperts
from vllm_specexpert.tiers.store import SlotShapes

_PROVEN: set[str] = set()
"""Packs whose bytes matched a layer's runtime form in this process."""


def check_pack_form(
    layer: Any, experts: PackExperts, slot_shapes: SlotShapes, checkpoint: str
) -> None:
    """Refuse the pack of ``experts`` unless its tensors are what ``layer``'s kernel
    reads: the same shapes and dtypes as the layer's slots, the kernel's ISA, and (once
    per pack) the bytes of expert 0 as vLLM would make them from ``checkpoint``."""
    pack = experts.pack
    form = pack.form
    kernel_isa = getattr(layer.slot_kernel.direct_experts(), "isa", None)
    problem = None
    if experts.held_shapes() != slot_shapes:
        problem = (
            f"holds {experts.name}'s experts shaped {_shapes(experts.held_shapes())}; the "
            f"layer's kernel reads {_shapes(slot_shapes)}"
        )
    elif form.layout == "cpu-prepacked" and form.isa != kernel_isa:
        problem = (
            f"holds experts in {form.describe()}; this machine's expert kernel runs the "
            f"{kernel_isa or 'unprepacked'} layout"
        )
    elif str(pack.path) not in _PROVEN:
        dtype = next(iter(slot_shapes.values()))[1]
        expert = CheckpointExperts(checkpoint)(experts.name, 0)
        made = runtime_form(layer, {k: t[None].to(dtype) for k, t in expert.items()})
        stored = experts.gather(np.zeros(1, dtype=np.int64))
        if any(not torch.equal(_bits(made[k][0].cpu()), _bits(stored[k][0])) for k in stored):
            problem = (
                f"holds experts in {form.describe()}, and expert 0 of {experts.name} "
                "differs from what this vLLM build makes of the checkpoint's"
            )
        _PROVEN.add(str(pack.path))
    if problem is not None:
        _PROVEN.discard(str(pack.path))
        raise SpecExpertConfigError(
            FIELD,
            f"{pack.path} {problem} (a pack made on another machine or by another version)",
            f"remove {pack.path}: the plugin makes the pack again on the next start (or "
            f"`specexpert pack {checkpoint} --out {pack.path}` makes it ahead)",
        )


def _shapes(shapes: SlotShapes) -> str:
    return ", ".join(
        f"{name} {list(shape)} {str(dtype).removeprefix('torch.')}"
        for name, (shape, dtype) in shapes.items()
    )


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)
