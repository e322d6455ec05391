"""Early Fire and No-Stop: with experts on peers, a layer's prediction of the next sends
rows to the predicted experts' peers before that layer's router is final.

* ``early_fire``: layer l+1's own rows leave before its router ids are read; wrong
  guesses are sent again once they are known. Equivalent.
* ``no_stop``: layer l sends its estimate of layer l+1's router input as soon as the
  prediction exists; layer l+1 runs the predicted routing and takes the peers' results.
  Approximate twice over.

Only pairs whose expert a peer in rotation holds and the device cache lacks are sent.
Details and measurements: docs/design.md, "Experts across machines (mesh)".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from vllm_specexpert.peers.layer_view import LayerPeers
from vllm_specexpert.peers.tier import Sent
from vllm_specexpert.predict import Prediction
from vllm_specexpert.tiers.cache import ExpertCache


class FiredCount(Protocol):
    fired_entries: int


class EarlyFire:
    """Sends predicted pairs ahead; one per engine under a mesh mode other than ``sync``."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.speculates = mode == "no_stop"
        """The layer runs the predicted routing when something was fired for it."""
        self._ahead: dict[int, Sent] = {}
        """``no_stop``: layer index -> what layer l fired for it."""

    def fire(
        self,
        peers: LayerPeers,
        cache: ExpertCache,
        x: torch.Tensor,
        ids: np.ndarray,
        stats: FiredCount,
    ) -> Sent | None:
        """Send rows ``x`` for the predicted ``ids`` ([T, K], host) whose expert a peer
        in rotation holds and ``cache`` lacks; counted in the target layer's ``stats`` (its
        peer place's counters)."""
        wanted = peers.hosted()[ids] & (cache.expert_slot[ids] < 0)
        if not wanted.any():
            return None
        tokens, cols = np.nonzero(wanted)
        stats.fired_entries += len(tokens)
        return peers.send(x, tokens, ids[tokens, cols])

    def at_call(
        self,
        peers: LayerPeers | None,
        cache: ExpertCache,
        x: torch.Tensor,
        prediction: Prediction | None,
        stats: FiredCount,
    ) -> Sent | None:
        """At the start of a layer's decode call: what is fired for its tokens."""
        if peers is None:
            return None
        if self.speculates:
            sent = self._ahead.pop(peers.layer, None)
            return sent if sent is not None and prediction is not None else None
        if prediction is None or prediction.host_ids is None:
            return None
        return self.fire(peers, cache, x, prediction.host_ids, stats)

    def predicted(
        self,
        peers: LayerPeers,
        cache: ExpertCache,
        stats: FiredCount,
        prediction: Prediction,
        router_input: Callable[[], torch.Tensor],
    ) -> None:
        """Layer l predicted the next layer: ``no_stop`` fires the estimate of its router
        input now (``router_input`` computes it if the prediction did not keep it)."""
        if not self.speculates:
            return
        assert prediction.host_ids is not None  # read with the router's ids (the read)
        q = prediction.router_input if prediction.router_input is not None else router_input()
        sent = self.fire(peers, cache, q, prediction.host_ids, stats)
        if sent is not None:
            self._ahead[peers.layer] = sent

    def clear(self) -> None:
        self._ahead.clear()
