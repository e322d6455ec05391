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
* **Saturation**: when the round ends, each request's routes wait for its next
  verification; a target pass's demand (:class:`~vllm_specexpert.handoff.StepDemand`)
  is the routes of the requests it runs: under ``cache: plec`` the shared pool evicts by
  it first (the k-token lookahead), and its coverage of the experts the verification
  really used is counted (``path_covered / path_needed``).
* **Held back**: the token scheduler runs a group of the requests per step, so a
  request's verification may come steps after its round, and the pass after a round
  verifies other requests' drafts. When a pass starts, the routes of its requests that
  sat out the last round are primed and prefetched again (what their round prefetched
  may have been evicted since). Their round's own prefetch is still made: the worker
  does not know whom the scheduler runs next.

The paper's bandwidth-guided middle phase (prefetch only part of the middle passes) is
not built: on the embedded model every predicted expert fits the link's time between
passes (the prefetch room of the pool is the only limit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

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
        self.routes: dict[str, dict[int, np.ndarray]] = {}
        """Request -> its routes in the round it drafted in last (decoder-layer index ->
        ``[E]`` router weight mass): the demand of its next verification."""
        self.last_round: set[str] = set()
        """The requests of the last round."""
        self.demand: StepDemand | None = None
        """The demand of the running target pass."""
        self.active = False
        """A round runs (the draft's passes outside one, vLLM's warm-up, are ignored)."""

    def round_started(self, requests: list[str]) -> None:
        """The draft starts a round for ``requests`` (the batch's order)."""
        self.buffer.begin(requests)
        self.active = True

    def draft_routed(self, layer_index: int, ids: np.ndarray, weights: np.ndarray) -> None:
        """The draft's layer ``layer_index`` routed a pass: prime and prefetch the
        target's layer of that index."""
        if not self.active:
            return
        routes = self.buffer.record(layer_index, ids, weights)
        if routes.ids.size:
            mass = np.zeros(self.buffer.num_experts)
            np.add.at(mass, routes.ids.ravel(), routes.weights.ravel())
            self._load_ahead(layer_index, mass)

    def _load_ahead(self, layer_index: int, mass: np.ndarray) -> None:
        """Prime the target layer's resident experts of ``mass`` (``[E]``) and queue the
        others on the link, most mass first."""
        layer = self.layer_of(layer_index)
        if layer is None:
            return
        cache = layer.cache
        predicted = np.flatnonzero(mass)
        resident = predicted[cache.expert_slot[predicted] >= 0]
        if len(resident):
            cache.touch(resident)
        wanted = predicted[cache.expert_slot[predicted] < 0]
        if len(wanted):
            wanted = wanted[np.argsort(-mass[wanted], kind="stable")]
            layer.loader.prefetch(wanted, layer.stats.decode)

    def round_ended(self) -> None:
        """The draft has drafted: each request's routes wait for its verification."""
        self.active = False
        self.routes.update(self.buffer.by_request())
        self.last_round = set(self.buffer.requests)

    def pass_started(self, requests: Iterable[str], gone: Iterable[str]) -> None:
        """A target pass of ``requests`` starts (``gone``: requests finished or preempted
        since the last pass, whose routes are dropped): its demand is their routes, and
        the routes of those that sat out the last round are loaded ahead (module doc)."""
        for request in gone:
            self.routes.pop(request, None)
        running = [r for r in requests if r in self.routes]
        if not running:
            self.demand = None
            return
        layers = {
            index: np.sum([self.routes[r][index] for r in running], axis=0)
            for index in self.routes[running[0]]
        }
        self.demand = StepDemand(tokens=None, layers=layers)
        returning = [r for r in running if r not in self.last_round]
        for index in sorted(layers) if returning else ():  # (the first layers' loads first)
            self._load_ahead(index, np.sum([self.routes[r][index] for r in returning], axis=0))
