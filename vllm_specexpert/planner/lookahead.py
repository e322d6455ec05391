"""The draft's routes as the target's lookahead (MoE-SpeQ §3.3.2).

While the draft runs, each of its MoE layers hands its routes for the tokens the target
verifies next (:class:`~vllm_specexpert.predict.draft.ExpertLookaheadBuffer`) to the
target's layer of the same index:

* **Priming** (every pass): the predicted experts already resident are touched, so the
  cache's recency keeps them through the loads that follow (they cost no link time).
* **Prefetch** (every pass): the predicted experts not resident are queued on the link,
  most router weight first, protected until the target layer's next call
  (:meth:`~vllm_specexpert.tiers.loader.ExpertLoader.prefetch`); the loads run while the
  draft computes its later layers and passes. A later pass adds its own.
* **Saturation**: when the round ends, the whole buffer becomes the verification pass's
  demand (:class:`~vllm_specexpert.handoff.StepDemand`): under ``cache: plec`` the shared
  pool evicts by it first (the k-token lookahead), and its coverage of the experts the
  verification really used is counted (``path_covered / path_needed``).

The paper's bandwidth-guided middle phase (prefetch only part of the middle passes) is
not built: on the embedded model every predicted expert fits the link's time between
passes (the prefetch room of the pool is the only limit).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from vllm_specexpert.handoff import StepDemand
from vllm_specexpert.planner import PlannedLayer
from vllm_specexpert.predict.draft import ExpertLookaheadBuffer


class LookaheadPlanner:
    """Prefetch and demand from the draft's routes (module doc)."""

    def __init__(self, num_experts: int, layer_of: Callable[[int], PlannedLayer | None]) -> None:
        self.buffer = ExpertLookaheadBuffer(num_experts)
        self.layer_of = layer_of
        """Decoder-layer index -> the target's offloaded layer (``None``: not one)."""
        self.demand: StepDemand | None = None
        """The demand of the next verification pass (``None`` during a round)."""
        self.active = False
        """A round runs (the draft's passes outside one, vLLM's warm-up, are ignored)."""

    def round_started(self) -> None:
        """A drafting round starts (its first pass's rows come later: ``first_rows``)."""
        self.buffer.begin()
        self.demand = None
        self.active = True

    def draft_routed(self, layer_index: int, ids: np.ndarray, weights: np.ndarray) -> None:
        """The draft's layer ``layer_index`` routed a pass: prime and prefetch the
        target's layer of that index."""
        if not self.active:
            return
        routes = self.buffer.record(layer_index, ids, weights)
        layer = self.layer_of(layer_index)
        if layer is None or not routes.ids.size:
            return
        cache = layer.cache
        mass = np.bincount(
            routes.ids.ravel(),
            routes.weights.ravel().astype(np.float64),
            minlength=cache.num_experts,
        )
        predicted = np.flatnonzero(mass)
        resident = predicted[cache.expert_slot[predicted] >= 0]
        if len(resident):
            cache.touch(resident)
        wanted = predicted[cache.expert_slot[predicted] < 0]
        if len(wanted):
            wanted = wanted[np.argsort(-mass[wanted], kind="stable")]
            layer.loader.prefetch(wanted, layer.stats.decode)

    def round_ended(self) -> None:
        """The draft has drafted: its buffer is the next verification pass's demand."""
        self.active = False
        self.demand = StepDemand(tokens=None, layers=dict(self.buffer.demand))
