"""Early Fire and No-Stop (the mesh notes): predictions send rows to peers ahead.

With experts on peers, the round trip takes the place of the copy. A layer's prediction
of the next one names the peers that host its likely experts, so rows can leave before
that layer's router is final:

* ``early_fire``: when layer l+1 is called, its rows go to the peers of the experts
  predicted for it at layer l, before the router's ids are read to the host (the read,
  the next prediction and the local decisions overlap the network). Once the ids are
  known, pairs the prediction got right are kept, and the rest are sent then. The
  experts run are the router's and their inputs are the layer's own rows: equivalent.
* ``no_stop``: at layer l, as soon as layer l+1's prediction exists (before layer l
  waits for its own peers), the predictor's estimate of layer l+1's router input (q_l
  for ``quasi_hidden``, s_l for ``router``) goes to the peers of the predicted experts,
  and the peers compute on arrival. Layer l+1 then runs the predicted routing (as
  ``speculate`` does) and takes the peers' results for their pairs without waiting for
  its router. Two layers' requests are in flight at once, so a layer waits about half a
  round trip. Approximate twice over (predicted experts and weights; the peers' input is
  the estimate, not the true router input).

An exact result needs layer l+1's own input, which exists only after layer l+1's
attention: ``early_fire`` cannot hide the round trip itself (measured: no faster than
``sync``, ``docs/benchmarks.md``).

Only pairs whose expert a peer in rotation holds and the device cache lacks are sent.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm_specexpert.predict import Prediction
from vllm_specexpert.stats import PhaseStats
from vllm_specexpert.tiers.cache import ExpertCache
from vllm_specexpert.tiers.layer_peers import LayerPeers
from vllm_specexpert.tiers.peer import Sent


class EarlyFire:
    """Sends predicted pairs ahead (module doc); one per engine under a mesh mode other
    than ``sync``."""

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
        stats: PhaseStats,
    ) -> Sent | None:
        """Send rows ``x`` for the predicted ``ids`` ([T, K], host) whose expert a peer
        in rotation holds and ``cache`` lacks; counted in the target layer's ``stats``."""
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
        stats: PhaseStats,
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
        stats: PhaseStats,
        prediction: Prediction,
        router_input: Callable[[], torch.Tensor],
    ) -> None:
        """Layer l predicted the next layer (its ``peers``, ``cache`` and decode
        ``stats``): ``no_stop`` fires the estimate of its router input now
        (``router_input`` computes it when the prediction did not keep it)."""
        if not self.speculates:
            return
        assert prediction.host_ids is not None  # read with the router's ids (after_read)
        q = prediction.router_input if prediction.router_input is not None else router_input()
        sent = self.fire(peers, cache, q, prediction.host_ids, stats)
        if sent is not None:
            self._ahead[peers.layer] = sent

    def clear(self) -> None:
        self._ahead.clear()
