"""``speculate``: run the experts predicted at the previous layer, with the predicted
weights, instead of the router's (speculating-experts §4, "speculative execution").

A correct prefetch leaves nothing to load; outputs are approximate. Predicted experts
that were not prefetched load on demand; layers without a prediction (the first MoE
layer, ``exact_layers``, prefill) run exactly.
"""

from __future__ import annotations

from vllm_specexpert.config.modes import MISS_POLICIES
from vllm_specexpert.policy.fetch import FetchPolicy


class SpeculatePolicy(FetchPolicy):
    """The trait ``speculates`` makes the engine run the prediction's routing; misses fetch."""

    spec = MISS_POLICIES["speculate"]
