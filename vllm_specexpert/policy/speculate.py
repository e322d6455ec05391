"""``speculate``: run the experts predicted at the previous layer, with the predicted
weights, instead of the router's (speculating-experts §4, "speculative execution").

A correct prefetch then leaves nothing to load and no re-fetch of the router's true
choice; the price is that outputs are no longer exact (stats say ``output: approximate``).
Predicted experts that did not fit in the prefetch are loaded on demand, and layers
without a prediction (the first MoE layer, ``exact_layers``, prefill) run exactly.
"""

from __future__ import annotations

from vllm_specexpert.config.modes import MISS_POLICIES
from vllm_specexpert.policy.fetch import FetchPolicy


class SpeculatePolicy(FetchPolicy):
    """Its trait ``speculates`` makes the engine run the prediction's routing
    (:meth:`~vllm_specexpert.predict.Prediction.routing_like`); misses are fetched."""

    spec = MISS_POLICIES["speculate"]
