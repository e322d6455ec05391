"""``drop``: run only the resident selected experts, their weights renormalised so that
each token's routed weights keep their sum (a common baseline; output changes)."""

from __future__ import annotations

import numpy as np
import torch

from vllm_specexpert.config.modes import MISS_POLICIES
from vllm_specexpert.places import Dropped
from vllm_specexpert.policy.base import MissContext, MissPlan, MissPolicy


class DropPolicy(MissPolicy):
    spec = MISS_POLICIES["drop"]

    def plan(
        self,
        ids: np.ndarray,
        resident: np.ndarray,
        topk_weights: torch.Tensor,
        context: MissContext,
    ) -> MissPlan:
        return MissPlan(topk_ids=ids, places={Dropped.name: ~resident[ids]}, renormalize=True)
