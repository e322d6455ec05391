"""``lowbit``: run a missing expert's INT4 copy (HOBBIT).

Every expert of a bf16 model also has an INT4 copy in the slow tier, made at load. A
decode entry whose expert is missing runs that copy instead: moved packed (about a
quarter of the bytes) into the layer's low-bit slots, dequantized there, and computed
with the same kernel. With ``admit_host_experts`` the bf16 expert is then loaded in the
background when the link is idle (HOBBIT's cache update; measured: it keeps the link
busy at batch 1, see the docs). The low-bit slots are a few of the layer's own
(``top_k``, out of its budget), so a call's missing experts beyond them are fetched in
bf16 as usual, the most used first kept for the low-bit slots."""

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
