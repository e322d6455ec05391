"""``speculate``: run the experts predicted at the previous layer, with the predicted
weights, instead of the router's (speculating-experts §4, "speculative execution").

A correct prefetch then leaves nothing to load and no re-fetch of the router's true
choice; the price is that outputs are no longer exact (stats say ``output: approximate``).
Predicted experts that did not fit in the prefetch are loaded on demand, and layers
without a prediction (the first MoE layer, ``exact_layers``, prefill) run exactly.
"""

from __future__ import annotations

import torch

from vllm_specexpert.config.modes import MISS_POLICIES
from vllm_specexpert.policy.fetch import FetchPolicy
from vllm_specexpert.predict import Prediction


class SpeculatePolicy(FetchPolicy):
    spec = MISS_POLICIES["speculate"]

    def routing(
        self, topk_weights: torch.Tensor, topk_ids: torch.Tensor, prediction: Prediction | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if prediction is None:
            return topk_weights, topk_ids
        return prediction.topk_weights.to(topk_weights.dtype), prediction.topk_ids.to(topk_ids.dtype)
