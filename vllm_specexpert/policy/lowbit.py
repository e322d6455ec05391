"""``lowbit``: run a missing expert's INT4 copy (HOBBIT).

A missing expert's INT4 copy (made at load, a quarter of the bytes) is moved into the
layer's low-bit slots (``top_k`` of its budget), dequantized and run with the same
kernel; missing experts beyond those slots are fetched in bf16 (the most used get the
low-bit slots). With ``admit_host_experts`` the bf16 expert is then loaded on an idle
link (docs/design.md, "``lowbit``")."""

from __future__ import annotations

import numpy as np
import torch

from vllm_specexpert.config.modes import MISS_POLICIES
from vllm_specexpert.policy.base import MissContext, MissPlan, MissPolicy


class LowBitPolicy(MissPolicy):
    spec = MISS_POLICIES["lowbit"]

    def plan(
        self,
        ids: np.ndarray,
        resident: np.ndarray,
        topk_weights: torch.Tensor,
        context: MissContext,
    ) -> MissPlan:
        assert context.low_bit is not None, "lowbit's context has its low-bit slots"
        missing = ~resident[ids]
        experts, rows = np.unique(ids[missing], return_counts=True)
        room = context.low_bit.cache.num_slots
        if len(experts) > room:  # the most used run low-bit, the rest are fetched
            experts = experts[np.argsort(-rows, kind="stable")[:room]]
        return MissPlan(topk_ids=ids, low_bit=missing & np.isin(ids, experts))
