"""The peer tier (``mesh``): experts held and computed by Ray actors on other nodes.

A peer's "copy" is a remote computation: the engine sends a layer's rows and the
(row, expert) pairs to compute, the peer (:class:`~.shard.ExpertPeer`) answers with
one unweighted output per pair, and the layer adds them with its routing weights. Calls
are direct Ray actor calls from the engine's worker process to each peer (no
coordinator); a peer runs two calls at once (``max_concurrency=2``), so the next layer's
rows are received while the current ones compute (double buffering).

:class:`PeerTier` is the engine's side, made of the parts: the peers placed, started and
checked (:mod:`.start`), the calls to them (:mod:`.calls`), their probes and the
rotation (:mod:`.health`), each peer's state and counters (:mod:`.peer_state`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from vllm_specexpert.config.sections import MeshConfig
from vllm_specexpert.peers import calls
from vllm_specexpert.peers.calls import Sent, answer_timeout_s
from vllm_specexpert.peers.check import PairReference
from vllm_specexpert.peers.health import Prober
from vllm_specexpert.peers.peer_state import PeerState, in_rotation
from vllm_specexpert.peers.ray_cluster import init_ray, require_ray
from vllm_specexpert.peers.shard import ExpertPeer, ShardSpec
from vllm_specexpert.peers.start import check_at_start, launch, peer_checks, placement, wait_loaded

__all__ = ["PeerState", "PeerTier", "Sent"]


class PeerTier:
    """The engine's side of the mesh: placement, checks, calls, health (module doc)."""

    def __init__(
        self,
        mesh: MeshConfig,
        spec: ShardSpec,
        num_experts: int,
        reference: PairReference,
        local: dict[int, np.ndarray] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        peer_class: type[ExpertPeer] = ExpertPeer,
    ) -> None:
        self.mesh = mesh
        self.clock = clock
        """Seconds that round trips and timeouts are measured in."""
        self.peer_class = peer_class
        """The class of the peers' Ray actors (made remote at start): :class:`ExpertPeer`, or
        a subclass that answers otherwise."""
        self.num_experts = num_experts
        self.spec = spec
        ray = require_ray()
        self._started_ray = init_ray(ray, mesh.ray_address)
        self.peers: list[PeerState] = []
        try:
            self.hosts = placement(spec, mesh.peers, num_experts, local or {})
            """Layer -> ``[E, peers]`` bool: which peers hold each expert (hot ones: none)."""
            self.peers = launch(ray, peer_class, spec, self.hosts, mesh.peers)
            wait_loaded(ray, self.peers, spec.checkpoint)
            self.checks = peer_checks(spec, self.hosts, self.peers, reference)
            """Rank -> the pairs it computes to prove it works (at start, after a restart)."""
            check_at_start(self.peers, self.checks)
        except BaseException:
            self.close()  # (a peer that failed, or this host's check: none is left running)
            raise
        self.prober = Prober(self.peers, self.checks)

    @property
    def timeout_s(self) -> float:
        return answer_timeout_s(self.mesh)

    def hosted(self, layer: int) -> np.ndarray:
        """``[E]`` experts of ``layer`` that a peer in rotation holds (probes first)."""
        self.prober.probe(self.mesh, self.clock)
        return (self.hosts[layer] & in_rotation(self.peers)).any(axis=1)

    def send(self, layer: int, x: torch.Tensor, tokens: np.ndarray, experts: np.ndarray) -> Sent:
        """Start computing expert ``experts[i]`` on row ``tokens[i]`` of ``x`` at the
        peers that hold them (pairs whose experts no peer in rotation holds are not
        sent: :meth:`receive` reports them failed)."""
        return calls.send(self.peers, self.hosts[layer], layer, x, tokens, experts, self.clock)

    def receive(self, sent: Sent) -> tuple[torch.Tensor, np.ndarray]:
        """``[N, H]`` float32 outputs of the sent pairs and ``[N]`` which arrived; a
        peer that failed or did not answer within ``timeout_ms`` of the send leaves the
        rotation."""
        return calls.receive(sent, self.timeout_s, self.clock)

    def stats(self) -> dict:
        return {
            "peers": [p.stats() for p in self.peers],
            "mode": self.mesh.mode,
            "placement": self.mesh.placement,
            "rtt_cap_ms": self.mesh.rtt_cap_ms,
        }

    def reset_stats(self) -> None:
        self.prober.probe_at_next_call()  # (probe_interval_s may have changed)
        for peer in self.peers:
            peer.reset()

    def close(self) -> None:
        ray = sys.modules.get("ray")  # (at interpreter exit an import would fail)
        if ray is None:
            return
        for peer in self.peers:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(peer.actor)
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
