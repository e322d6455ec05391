"""Experts on mesh peers as an engine feature: the peer tier's stats and lifetime, and
Early Fire (``early_fire``, ``no_stop``: :mod:`vllm_specexpert.planner.early_fire`), which
sends rows to the peers of predicted experts ahead of the router. The entries of experts a
peer holds go to it before the miss policy decides (:class:`~vllm_specexpert.policy.peers.
PeersFirst`); each layer joins its peers when the feature equips it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from vllm_specexpert.config.sections import MeshConfig
from vllm_specexpert.features.base import DecodeCall, EngineFeature
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.planner.early_fire import EarlyFire
from vllm_specexpert.policy import MissPolicy, PeersFirst
from vllm_specexpert.tiers.layer_peers import LayerPeers
from vllm_specexpert.tiers.peer import PeerTier


class MeshFeature(EngineFeature):
    name = "mesh"

    def __init__(
        self,
        tier: PeerTier,
        hot: dict[int, np.ndarray],
        mesh: MeshConfig,
        output: str,
        layer: Callable[[str], OffloadedLayer],
    ):
        self.tier = tier
        self.hot = hot
        """Per layer index: experts pinned on the device instead (``replicate_hot``)."""
        tier.mesh = mesh  # (mode and timings change with reconfigure)
        self.output = output
        self.layer = layer
        self.early_fire = EarlyFire(mesh.mode) if mesh.mode != "sync" else None

    def equip(self, layer: OffloadedLayer) -> None:
        layer.join_peers(LayerPeers(self.tier, layer.index), self.hot.get(layer.index))

    def miss_policy(self, policy: MissPolicy) -> MissPolicy:
        return PeersFirst(policy)

    def begin_call(self, call: DecodeCall) -> None:
        if self.early_fire is None:
            return
        layer = call.layer
        fired = self.early_fire.at_call(
            layer.peers, layer.cache, call.x, call.shared.get("prediction"), call.stats
        )
        if layer.peers is not None:
            layer.peers.fired = fired
        if fired is not None and self.early_fire.speculates:
            call.shared["run_prediction"] = True  # no_stop: run what was fired for

    def end_call(self, call: DecodeCall) -> None:
        if call.layer.peers is not None:
            call.layer.peers.fired = None  # sent for this call's rows only

    def after_read(self, call: DecodeCall) -> None:
        upcoming, next_name = call.shared.get("upcoming"), call.layer.next_name
        if self.early_fire is not None and upcoming is not None and next_name is not None:
            # no_stop: the next layer's rows leave now.
            self.early_fire.predicted(
                self.layer(next_name), upcoming, call.shared["next_router_input"]
            )

    def stats(self) -> dict:
        return self.tier.stats()

    def summary(self) -> str:
        mesh = self.tier.mesh
        up = sum(peer.up for peer in self.tier.peers)
        return (
            f"; mesh {mesh.mode} ({self.output}), {up} of {mesh.peers} peers in "
            f"rotation, placement {mesh.placement}"
        )

    def reset_stats(self) -> None:
        self.tier.reset_stats()

    def close(self) -> None:
        self.tier.close()
