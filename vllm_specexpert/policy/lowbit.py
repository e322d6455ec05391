"""``lowbit``: run a missing expert's INT4 copy (HOBBIT).

A missing expert's INT4 copy (made at load, a quarter of the bytes) is moved into the
layer's low-bit slots (``top_k`` of its budget), dequantized and run with the same
kernel; missing experts beyond those slots are fetched in bf16 (the most used get the
low-bit slots). With ``admit_host_experts`` the bf16 expert is then loaded on an idle
link (docs/design.md, "``lowbit``")."""

from __future__ import annotations

from typing import Protocol, cast

import numpy as np
import torch

from vllm_specexpert.config.modes import MISS_POLICIES
from vllm_specexpert.policy.base import MissContext, MissPlan, MissPolicy

LOW_BIT = "low_bit"
"""The place of INT4 copies (registered by the ``low_bit`` feature)."""


class LowBitSlots(Protocol):
    @property
    def room(self) -> int:
        """How many experts' copies one call can run."""
        ...


class LowBitPolicy(MissPolicy):
    spec = MISS_POLICIES["lowbit"]

    def plan(
        self,
        ids: np.ndarray,
        resident: np.ndarray,
        topk_weights: torch.Tensor,
        context: MissContext,
    ) -> MissPlan:
        missing = ~resident[ids]
        experts, rows = np.unique(ids[missing], return_counts=True)
        room = cast(LowBitSlots, context.places[LOW_BIT]).room
        if len(experts) > room:  # the most used run low-bit, the rest are fetched
            experts = experts[np.argsort(-rows, kind="stable")[:room]]
        return MissPlan(topk_ids=ids, places={LOW_BIT: missing & np.isin(ids, experts)})
