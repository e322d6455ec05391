"""Starting the mesh's peers: which peer holds which experts (placement), their Ray actors
started on other nodes, each loading its shard, and each proving it computes before it
takes traffic.

The proof is one real call per layer held: at start every peer answers its check, a few
(row, expert) pairs of every layer it holds, compared with this host's result of the same
pairs (``reference``, :mod:`.check`); a peer that crashes, hangs or answers otherwise is
refused at start with its reason.
"""

from __future__ import annotations

import time
from types import ModuleType

import numpy as np

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.log import init_logger
from vllm_specexpert.peers.check import (
    PairReference,
    PeerCheck,
    check_failure,
    checks_of,
    send_check,
)
from vllm_specexpert.peers.peer_state import PeerState
from vllm_specexpert.peers.ray_cluster import first_line
from vllm_specexpert.peers.shard import ExpertPeer, ShardSpec

logger = init_logger(__name__)

START_TIMEOUT_S = 300.0
"""How long the engine waits at start for every peer to load its shard (and, again,
to answer its check)."""


def placement(
    spec: ShardSpec, peers: int, num_experts: int, hot: dict[int, np.ndarray]
) -> dict[int, np.ndarray]:
    """Layer -> ``[E, peers]`` bool: which peers hold each expert of ``spec``'s layers
    (the ``hot`` ones, kept on this host: none)."""
    hosts = {}
    for layer in spec.layers:
        mask = np.zeros((num_experts, peers), dtype=bool)
        cold = np.setdiff1d(np.arange(num_experts), hot.get(layer, []))
        mask[cold, np.arange(len(cold)) % peers] = True  # round robin: balanced
        hosts[layer] = mask
    return hosts


def launch(
    ray: ModuleType,
    peer_class: type[ExpertPeer],
    spec: ShardSpec,
    hosts: dict[int, np.ndarray],
    count: int,
) -> list[PeerState]:
    """``count`` actors of ``peer_class``, each loading its shard of ``hosts`` (not
    waited for): each on a node of its own where the cluster has enough besides this
    one, else all on this node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
    remote = ray.remote(peer_class)
    peers = []
    for rank in range(count):
        node = nodes[rank] if len(nodes) >= count else here
        shard = ShardSpec(
            spec.checkpoint,
            {
                layer: (name, tuple(int(e) for e in np.flatnonzero(hosts[layer][:, rank])))
                for layer, (name, _) in spec.layers.items()
            },
            spec.w13_shape,
            spec.isa,
            spec.activation,
        )
        actor = remote.options(
            num_cpus=0,
            max_restarts=-1,
            max_task_retries=0,
            max_concurrency=2,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(rank, shard)
        peers.append(PeerState(rank=rank, actor=actor, node=node))
    return peers


def wait_loaded(ray: ModuleType, peers: list[PeerState], checkpoint: str) -> None:
    """Wait for every peer to load its shard and note its process and kernel ISA; a
    peer that cannot is the error naming it."""
    waits = [peer.actor.ready.remote() for peer in peers]
    for peer, wait in zip(peers, waits, strict=True):
        try:
            ready = ray.get(wait, timeout=START_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - any failure is the same fix
            raise SpecExpertConfigError(
                "mesh",
                f"peer {peer.rank} (node {peer.node[:12]}) could not load its "
                f"shard of {checkpoint}: {first_line(error)}",
                "put the checkpoint at the same path on every node of the Ray "
                "cluster, with this package installed",
            ) from None
        peer.pid, peer.isa = ready["pid"], ready["isa"]


def peer_checks(
    spec: ShardSpec, hosts: dict[int, np.ndarray], peers: list[PeerState], reference: PairReference
) -> dict[int, list[PeerCheck]]:
    """Rank -> the pairs that peer computes to prove it works (at start, after a
    restart), of the experts ``hosts`` gives it."""
    return {
        peer.rank: checks_of(
            spec,
            {layer: np.flatnonzero(held[:, peer.rank]) for layer, held in hosts.items()},
            peer.rank,
            reference,
        )
        for peer in peers
    }


def check_at_start(peers: list[PeerState], checks: dict[int, list[PeerCheck]]) -> None:
    """Every peer answers its check, or the start is refused with its reason."""
    sent = [(peer, send_check(peer.actor, checks[peer.rank])) for peer in peers]
    deadline = time.perf_counter() + START_TIMEOUT_S
    for peer, answers in sent:
        failure = check_failure(
            checks[peer.rank], answers, max(0.0, deadline - time.perf_counter())
        )
        if failure is not None:
            raise SpecExpertConfigError(
                "mesh",
                f"peer {peer.rank} (node {peer.node[:12]}, kernel "
                f"{peer.isa or 'torch'}) failed its check: {failure}",
                "give every node the same checkpoint at the same path and the same "
                "vLLM build (the peer's own log is in Ray's session directory, "
                "logs/worker-*.err), or remove mesh",
            )
        pairs = sum(len(c.experts) for c in checks[peer.rank])
        logger.info(
            "specexpert: mesh peer %d (node %s, pid %d, kernel %s) checked: "
            "%d pairs of %d layers as computed here",
            peer.rank,
            peer.node[:12],
            peer.pid,
            peer.isa or "torch",
            pairs,
            len(checks[peer.rank]),
        )
