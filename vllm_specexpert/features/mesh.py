"""Experts on mesh peers as an engine feature: the peer tier's stats and lifetime, and
Early Fire (``early_fire``, ``no_stop``: :mod:`vllm_specexpert.planner.early_fire`), which
sends rows to the peers of predicted experts ahead of the router. The entries of experts a
peer holds go to it before the miss policy decides (:class:`PeersFirst`, each layer's
policy wrapped with its :class:`PeerPlace`); each layer joins its peers when the feature
equips it, and ``replicate_hot`` pins the hot experts in its cache."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.config.modes import MissPolicySpec
from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.peers.layer_view import LayerPeers
from vllm_specexpert.peers.peer_state import PeerState
from vllm_specexpert.peers.tier import PeerTier
from vllm_specexpert.pipeline import DecodeCall, Stage
from vllm_specexpert.places import Place, PlaceCounters
from vllm_specexpert.planner.early_fire import EarlyFire
from vllm_specexpert.policy import MissContext, MissPlan, MissPolicy
from vllm_specexpert.stats import PhaseStats, Series, counter, metric_name, seconds
from vllm_specexpert.tiers.host import HostKernel, compute_on_host
from vllm_specexpert.tiers.store import ExpertSource, LayerExperts


@dataclass
class PeerCounters(PlaceCounters):
    entries_field = "peer_entries"
    peer_entries: int = counter(
        "Missed entries computed by a mesh peer that holds the expert (``mesh``)."
    )
    peer_fallback_entries: int = counter(
        "Entries sent to a peer that failed or did not answer in time, computed "
        "locally instead (loaded on demand; also counted in ``fetched_entries``)."
    )
    fired_entries: int = counter(
        "(token, expert) entries sent to peers ahead of the layer's router, by the "
        "previous layer's prediction (``mesh.mode`` ``early_fire``, ``no_stop``)."
    )
    fired_used: int = counter(
        "Of those, entries the layer then ran: ``fired_used / fired_entries`` is "
        "Early Fire's hit rate."
    )
    peer_wait_s: float = seconds(
        "Seconds layer calls waited for peers' answers after their device work was done."
    )


class PeerPlace(Place):
    """Entries computed by the mesh peers that hold their experts; pairs fired ahead
    (Early Fire, :attr:`LayerPeers.fired`) are taken from what was sent then."""

    name = "peer"
    counters = PeerCounters

    def __init__(self, peers: LayerPeers):
        self.peers = peers

    def hosted(self) -> np.ndarray:
        return self.peers.hosted()

    def stage(self, call: LayerCall, entries: np.ndarray) -> tuple[LayerCall, Any]:
        return call, self.peers.stage(call.x, call.host_ids, entries)

    def finish(self, job: tuple[LayerCall, Any], out: torch.Tensor) -> np.ndarray:
        call, staged = job
        waited_from = time.perf_counter()
        counters = call.stats.part(PeerCounters)
        counters.fired_used += staged.reused
        failed = self.peers.finish(staged, out, call.topk_weights, call.host_ids.shape)
        counters.peer_wait_s += time.perf_counter() - waited_from
        counters.peer_fallback_entries += int(np.count_nonzero(failed))
        return failed


class PeersFirst(MissPolicy):
    """``policy`` with the entries of experts a peer in rotation holds sent to the peer:
    the policy sees those experts as resident and decides about the others."""

    def __init__(self, policy: MissPolicy, peers: PeerPlace) -> None:
        self.policy = policy
        self.peers = peers

    # The base's traits are a ClassVar; the wrapper's are its policy's, per instance.
    @property
    def spec(self) -> MissPolicySpec:  # type: ignore[override]  # (the wrapped policy's traits)
        return self.policy.spec

    def plan(
        self,
        ids: np.ndarray,
        resident: np.ndarray,
        topk_weights: torch.Tensor,
        context: MissContext,
    ) -> MissPlan | None:
        hosted = self.peers.hosted()
        remote = ~resident[ids] & hosted[ids]
        resident = resident | hosted
        plan = None
        if not resident[ids].all():
            plan = self.policy.plan(ids, resident, topk_weights, context)
        if not remote.any():
            return plan
        plan = plan or MissPlan(topk_ids=ids)
        plan.places[PeerPlace.name] = remote
        return plan


class MeshFeature(EngineFeature):
    name = "mesh"
    inputs = ("peer_tier", "hot_experts")

    def __init__(self, parts: EngineParts, tier: PeerTier, hot: dict[int, np.ndarray]):
        mesh = parts.config.mesh
        assert mesh is not None  # (built only under a mesh)
        self.tier = tier
        tier.mesh = mesh  # (mode and timings change with reconfigure)
        self.hot = hot
        """Per layer index: experts pinned on the device instead (``replicate_hot``)."""
        self.output = parts.output
        self.layers = parts.layers
        self.peers: dict[str, LayerPeers] = {}
        """Layer name -> its view of the peers."""
        self.early_fire = EarlyFire(mesh.mode) if mesh.mode != "sync" else None

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        tier = inputs.get("peer_tier")
        if tier is None or parts.config.mesh is None:
            return None
        return cls(parts, tier, inputs.get("hot_experts", {}))

    def equip(self, layer: OffloadedLayer) -> None:
        hot = self.hot.get(layer.index)
        if hot is not None:  # (first: a refused hot_count registers nothing)
            _pin(layer, hot)
        peers = self.peers[layer.name] = LayerPeers(self.tier, layer.index)
        layer.add_place(PeerPlace(peers))

    def unequip(self, layer: OffloadedLayer) -> None:
        self.peers.pop(layer.name, None)
        layer.places.unregister(PeerPlace.name)

    def miss_policy(self, policy: MissPolicy, layer: OffloadedLayer) -> MissPolicy:
        return PeersFirst(policy, layer.places.of(PeerPlace))

    def stages(self, layer: OffloadedLayer) -> Sequence[Stage]:
        """Early Fire: rows sent to peers ahead of the router at the call, and ahead of
        the next layer's once it is predicted (``no_stop``); nothing under ``sync``."""
        if self.early_fire is None:
            return ()
        return (
            Stage(
                "mesh.fire",
                "route",
                self._fire,
                makes=frozenset({"run_prediction"}),
                uses=frozenset({"prediction"}),
            ),
            Stage(
                "mesh.fire_next",
                "plan",
                self._fire_next,
                uses=frozenset({"upcoming", "next_router_input"}),
            ),
            Stage("mesh.forget", "finish", self._forget),
        )

    def _fire(self, call: DecodeCall) -> None:
        assert self.early_fire is not None  # (a stage only with Early Fire)
        layer = call.layer
        peers = self.peers[layer.name]
        peers.fired = self.early_fire.at_call(
            peers, layer.cache, call.x, call.prediction, call.stats.part(PeerCounters)
        )
        if peers.fired is not None and self.early_fire.speculates:
            call.run_prediction = True  # no_stop: run what was fired for

    def _forget(self, call: DecodeCall) -> None:
        self.peers[call.layer.name].fired = None  # sent for this call's rows only

    def _fire_next(self, call: DecodeCall) -> None:
        """``no_stop``: the next layer's rows leave now."""
        assert self.early_fire is not None  # (a stage only with Early Fire)
        upcoming, next_name = call.upcoming, call.layer.next_name
        if upcoming is not None and next_name is not None:
            assert call.next_router_input is not None  # (made with ``upcoming``)
            nxt = self.layers[next_name]
            self.early_fire.predicted(
                self.peers[next_name],
                nxt.cache,
                nxt.stats.decode.part(PeerCounters),
                upcoming,
                call.next_router_input,
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

    def series(self) -> list[Series]:
        """The peers in rotation; per peer (label ``peer``, its rank) :data:`PEER_COUNTERS`,
        whether it is up and its median probe round trip."""
        peers = self.tier.stats()["peers"]
        peer = ("peer",)
        counters = {
            key: Series(f"peer_{metric_name(key)}", "counter", doc, peer)
            for key, doc in PEER_COUNTERS.items()
        }
        up = Series("peer_up", "gauge", "1 while the mesh peer is in rotation.", peer)
        rtt = Series("peer_rtt_seconds", "gauge", "The mesh peer's median probe round trip.", peer)
        for state in peers:
            for key, family in counters.items():
                family.add(state[key], state["rank"])
            up.add(state["up"], state["rank"])
            if state["rtt_ms"] is not None:
                rtt.add(state["rtt_ms"] / 1e3, state["rank"])
        return [
            *counters.values(),
            up,
            rtt,
            Series(
                "mesh_peers_in_rotation",
                "gauge",
                "Mesh peers in rotation (the others' experts are computed here).",
            ).add(sum(state["up"] for state in peers)),
            Series("mesh_peers", "gauge", "Mesh peers started.").add(len(peers)),
        ]


def host_pairs(
    experts: ExpertSource, kernel: HostKernel | None, x: torch.Tensor, pairs: np.ndarray
) -> torch.Tensor:
    """Expert ``pairs[i]`` of ``experts`` on row ``i`` of ``x``, unweighted, computed on
    this host from the slow tier: what a mesh peer's check is compared with."""
    if kernel is None or not isinstance(experts, LayerExperts):
        raise SpecExpertConfigError(
            "mesh",
            "a peer's check is compared with this host's result of the same "
            "experts, and this model's expert layers have no host kernel",
            "remove mesh (this layer type cannot compute experts on the host)",
        )
    ids = torch.from_numpy(pairs.astype(np.int32))[:, None]
    return compute_on_host(experts, kernel, x, torch.ones(ids.shape, dtype=torch.float32), ids)


def _pin(layer: OffloadedLayer, experts: np.ndarray) -> None:
    """Load ``experts`` into the layer's cache now and never evict them."""
    slots = layer.cache.num_slots
    if len(experts) > slots - layer.top_k:
        raise SpecExpertConfigError(
            "mesh.hot_count",
            f"{len(experts)} pinned experts leave fewer than top_k "
            f"({layer.top_k}) of the layer's {slots} slots for the others",
            f"use hot_count <= {slots - layer.top_k}, or a larger budget",
        )
    layer.loader.acquire(np.asarray(experts), PhaseStats())
    layer.loader.wait_all()
    layer.cache.pin(experts)


PEER_COUNTERS = {key: doc for key, doc in PeerState.docs().items() if key != "call_s"}
"""The per-peer counters on ``/metrics`` (``specexpert_peer_<key>_total``), by the key
of a peer's stats (``PeerState.stats``); a call's round trip (``call_s``) is in the
stats only."""

FEATURE = MeshFeature
