"""The miss-policy interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from vllm_specexpert.cache import ExpertCache

ExpertKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor
]
"""``kernel(x, topk_weights, slot_ids, slots) -> out``: the layer's fused-experts kernel
run on the slot tensors ``slots`` (name -> ``[num_slots, ...]``), with router expert ids
already mapped to slot indices."""


class MissPolicy(ABC):
    """Runs one MoE layer's routed experts for a token batch, from the device cache."""

    name: str
    exact: bool
    """True when the output is bit-identical to running every expert resident."""

    @abstractmethod
    def run(
        self,
        cache: ExpertCache,
        kernel: ExpertKernel,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Routed-expert output for ``x`` ([tokens, hidden])."""
