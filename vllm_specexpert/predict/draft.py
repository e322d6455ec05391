"""MoE-SpeQ's expert lookahead buffer (ELB, MoE-SpeQ §3.3.1): the experts the draft
routes the tokens it drafts to, per MoE layer, with the router's weight as confidence.

vLLM's proposer runs the draft once on the step's tokens (only ``first_rows``, the tokens
verified next, are kept) and once per further drafted token; a layer index that does not
increase starts the next pass. A round of ``k`` drafts covers ``k`` of the ``k + 1``
verified tokens. Routes are kept per request: its verification may come steps later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class DraftRoutes:
    """One pass's routes at one layer: the verified-next tokens' experts."""

    draft_pass: int
    """0: the tokens the target sampled; ``j``: the ``j``-th drafted token."""
    ids: np.ndarray
    """``[R, K]`` expert ids, one row per request."""
    weights: np.ndarray
    """``[R, K]`` their router weights (the draft's confidence)."""


@dataclass
class ExpertLookaheadBuffer:
    """The routes of one drafting round (module doc)."""

    num_experts: int
    requests: list[str] = field(default_factory=list)
    """The round's requests, in the batch's order (one row each per pass)."""
    first_rows: np.ndarray | None = None
    """Rows of the first pass that are tokens verified next (``None``: the first rows,
    one per request)."""
    passes: int = 0
    """Passes recorded so far in this round."""
    masses: dict[int, np.ndarray] = field(default_factory=dict)
    """Decoder-layer index -> ``[R, E]`` router weight mass per request and expert over
    the round."""
    _last_layer: int = -1

    def begin(self, requests: list[str], first_rows: np.ndarray | None = None) -> None:
        """A drafting round of ``requests`` starts (``first_rows`` may come later)."""
        self.requests = requests
        self.first_rows = first_rows
        self.passes = 0
        self.masses = {}
        self._last_layer = -1

    def by_request(self) -> dict[str, dict[int, np.ndarray]]:
        """Request -> layer index -> ``[E]`` router weight mass over the round."""
        return {
            request: {layer: mass[row] for layer, mass in self.masses.items()}
            for row, request in enumerate(self.requests)
        }

    def record(self, layer_index: int, ids: np.ndarray, weights: np.ndarray) -> DraftRoutes:
        """Keep the verified-next rows of a draft layer's routing (host ``[T, K]``)."""
        if layer_index <= self._last_layer or self.passes == 0:
            self.passes += 1
        self._last_layer = layer_index
        draft_pass = self.passes - 1
        if draft_pass == 0 and self.first_rows is not None:
            rows = self.first_rows[self.first_rows < len(ids)]
            ids, weights = ids[rows], weights[rows]
        # (Rows past the requests' pad a batch to a captured graph's size.)
        ids, weights = ids[: len(self.requests)], weights[: len(self.requests)]
        mass = self.masses.get(layer_index)
        if mass is None:
            mass = self.masses[layer_index] = np.zeros((len(self.requests), self.num_experts))
        np.add.at(mass, (np.arange(len(ids))[:, None], ids), weights)
        return DraftRoutes(draft_pass, ids, weights)
