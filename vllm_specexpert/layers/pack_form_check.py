"""The expert pack's form checked against the kernel a layer really runs, when the layer
loads: a pack made for another ISA, dtype or vLLM build is refused naming ``disk.path``,
never run (docs/design.md, "The disk tier").

The pack's manifest names its form (:mod:`vllm_specexpert.tiers.kernel_form`), chosen
before any worker started. The proof is the layer's own: the first layer checked turns
one expert read from the checkpoint into vLLM's runtime form and compares its bytes with
the pack's. The expert is the first the pack can supply: one it cannot (a read error, a
record whose checksum fails) is logged as unreadable like any other read and fails only
the requests that need it; a layer none of whose experts can be read leaves the proof to
the next.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.handback import UnreadableRows
from vllm_specexpert.layers.packed_experts import runtime_form
from vllm_specexpert.tiers.checkpoint_experts import CheckpointExperts
from vllm_specexpert.tiers.expert_pack import FIELD
from vllm_specexpert.tiers.pack_experts import PackExperts
from vllm_specexpert.tiers.store import ExpertsUnreadable, SlotShapes

_PROVEN: set[str] = set()
"""Packs whose bytes matched a layer's runtime form in this process."""


def check_pack_form(
    layer: Any,
    experts: PackExperts,
    slot_shapes: SlotShapes,
    checkpoint: str,
    unreadable: UnreadableRows,
) -> None:
    """Refuse the pack of ``experts`` unless its tensors are what ``layer``'s kernel
    reads: the same shapes and dtypes as the layer's slots, the kernel's ISA, and (once
    per pack) the bytes of its first readable expert as vLLM would make them from
    ``checkpoint`` (the experts before it logged to ``unreadable``)."""
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
        found = _first_readable(experts, unreadable)
        if found is None:
            return
        index, stored = found
        dtype = next(iter(slot_shapes.values()))[1]
        expert = CheckpointExperts(checkpoint)(experts.name, index)
        made = runtime_form(layer, {k: t[None].to(dtype) for k, t in expert.items()})
        if any(not torch.equal(_bits(made[k][0].cpu()), _bits(stored[k][0])) for k in stored):
            problem = (
                f"holds experts in {form.describe()}, and expert {index} of {experts.name} "
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


def _first_readable(
    experts: PackExperts, unreadable: UnreadableRows
) -> tuple[int, dict[str, torch.Tensor]] | None:
    """The first expert the pack supplies, and its tensors; ``None`` if none can be read
    (each one that cannot, logged)."""
    for index in range(experts.num_experts):
        try:
            return index, experts.gather(np.array([index], dtype=np.int64))
        except ExpertsUnreadable as error:
            unreadable.log(error.layer, error.causes, "at the pack's form check: ")
    return None


def _shapes(shapes: SlotShapes) -> str:
    return ", ".join(
        f"{name} {list(shape)} {str(dtype).removeprefix('torch.')}"
        for name, (shape, dtype) in shapes.items()
    )


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)
