"""The draft's routes as the target's lookahead (MoE-SpeQ §3.3.2).

Each draft MoE layer's routes for the tokens verified next
(:class:`~vllm_specexpert.predict.draft.ExpertLookaheadBuffer`) go to the target's layer
of the same index: resident predicted experts are touched (priming), the others queued
on the link, most router weight first (prefetch). Each request's routes wait for its
next verification: a target pass's demand (:class:`~vllm_specexpert.handoff.StepDemand`)
is its requests' routes, and routes of requests the token scheduler held back are primed
and prefetched again when their pass starts (docs/design.md, "Draft lookahead").

The paper's bandwidth-guided middle phase is not built: on the embedded model every
predicted expert fits the link's time between passes.
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
        """Request -> its last round's routes (layer index -> ``[E]`` router weight mass)."""
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

    def round_skipped(self, requests: list[str]) -> None:
        """A round that drafts nothing for ``requests``: their next pass verifies no
        drafts, so it has no demand from them (and the draft's pass, which runs none of
        its experts, routes nothing worth loading)."""
        for request in requests:
            self.routes.pop(request, None)

    def draft_routed(self, layer_index: int, ids: np.ndarray, weights: np.ndarray) -> None:
        """Prime and prefetch the target's layer ``layer_index`` from the draft's routes."""
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
        """A target pass of ``requests`` starts (``gone``: finished or preempted, routes
        dropped): set its demand, and load ahead for those that sat out the last round."""
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
