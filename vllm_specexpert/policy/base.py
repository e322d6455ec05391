"""The miss-policy interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from vllm_specexpert.cache import ExpertCache
from vllm_specexpert.predict import Prediction

ExpertKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor
]
"""``kernel(x, topk_weights, slot_ids, slots) -> out``: the layer's fused-experts kernel
run on the slot tensors ``slots`` (name -> ``[num_slots, ...]``), with router expert ids
already mapped to slot indices."""


class MissPolicy(ABC):
    """Runs one MoE layer's routed experts for a token batch, from the device cache."""

    name: str

    def routing(
        self, topk_weights: torch.Tensor, topk_ids: torch.Tensor, prediction: Prediction | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing this policy executes, given the router's and the prediction made
        for this layer at the previous one (if any). Default: the router's."""
        return topk_weights, topk_ids

    @abstractmethod
    def run(
        self,
        cache: ExpertCache,
        kernel: ExpertKernel,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        before_kernel: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Routed-expert output for ``x`` ([tokens, hidden]) with the given routing.
        ``before_kernel`` is called once, when the first kernel launch's experts are
        resident and before it starts (the engine issues the next layer's prefetch
        there, so the copy overlaps this layer's expert compute)."""
