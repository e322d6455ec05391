"""The peer tier (``mesh``): experts held and computed by Ray actors on other nodes.

A peer's "copy" is a remote computation: the engine sends a layer's rows and the
(row, expert) pairs to compute, the peer (:class:`~.shard.ExpertPeer`) answers with
one unweighted output per pair, and the layer adds them with its routing weights. Calls
are direct Ray actor calls from the engine's worker process to each peer (no
coordinator); a peer runs two calls at once (``max_concurrency=2``), so the next layer's
rows are received while the current ones compute (double buffering).

A peer proves it computes before it takes traffic: at start it answers a check, a
few (row, expert) pairs of every layer it holds, compared with this host's result of
the same pairs (``reference``); a peer that crashes, hangs or answers otherwise is
refused at start with its reason. A restarted actor (a new process id) answers the same
check before it rejoins.

Faults: a call that raises (the actor died) or outlasts ``mesh.timeout_ms`` (hung)
takes its peer out of the rotation (logged once, a warning naming the peer and the
reason), and the engine computes the pairs locally. Every
``mesh.probe_interval_s`` the engine pings every peer, without blocking: each layer call
looks at the answers that came in. A peer whose median round trip exceeds
``mesh.rtt_cap_ms`` leaves the rotation; one out of it that answers under the cap
rejoins (Ray restarts a dead actor, ``max_restarts=-1``, which reloads its shard). A
ping's arrival time is taken by a callback on Ray's thread (read at the next layer
call, a round trip would include that call's own wait). Pings are sent from the
engine's thread: a prober thread's ``ray.get`` stalled while the worker waited on peers.
Experts of peers out of rotation are not remote: the miss policy serves them from the
local slow tier.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

import numpy as np
import torch

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.config.sections import MeshConfig
from vllm_specexpert.log import init_logger
from vllm_specexpert.peers.check import PairReference, check_failure, checks_of
from vllm_specexpert.peers.ray_cluster import first_line, init_ray, require_ray
from vllm_specexpert.peers.shard import ExpertPeer, ShardSpec

logger = init_logger(__name__)

START_TIMEOUT_S = 300.0
"""How long the engine waits at start for every peer to load its shard (and, again,
to answer its check)."""
RTT_WINDOW = 5
"""Probe round trips a peer's RTT is the median of."""


@dataclass
class PeerState:
    """One peer: its actor, whether it is in rotation, and its counters."""

    rank: int
    actor: Any
    """The Ray actor handle of its :class:`~.shard.ExpertPeer` (methods are called
    as ``actor.method.remote(...)``, attributes Ray makes at run time)."""
    node: str
    up: bool = True
    reason: str = ""
    """Why it is out of rotation (``failed: ...``, ``hung``, ``rtt``, ``check: ...``),
    while it is."""
    pid: int = 0
    """The actor's process id when it last passed its check."""
    isa: str | None = None
    """The CPU kernel ISA it computes with (``None``: plain PyTorch)."""
    checking: tuple[int, list] | None = None
    """A restarted actor's check in flight: its process id, the futures of
    :meth:`PeerTier._send_check`."""
    failed_pid: int = 0
    """The process id of an actor that failed its check (out until it restarts)."""
    rtts: deque = field(default_factory=lambda: deque(maxlen=RTT_WINDOW))
    calls: int = 0
    pairs: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    compute_s: float = 0.0
    call_s: float = 0.0
    """Seconds from send to answer, summed (includes the engine's own work meanwhile)."""
    failures: int = 0
    timeouts: int = 0
    left: int = 0
    rejoined: int = 0

    def leave(self, reason: str) -> None:
        if self.up:
            self.up, self.reason = False, reason
            self.left += 1
            logger.warning(
                "specexpert: mesh peer %d (node %s) left the rotation: %s; its "
                "experts are computed here until it answers probes again",
                self.rank,
                self.node[:12],
                reason,
            )

    def rejoin(self) -> None:
        self.up, self.reason = True, ""
        self.rejoined += 1
        logger.info(
            "specexpert: mesh peer %d (node %s) is back in rotation", self.rank, self.node[:12]
        )

    def stats(self) -> dict:
        rtt = float(np.median(self.rtts)) * 1e3 if self.rtts else None
        return {
            "rank": self.rank,
            "node": self.node,
            "up": self.up,
            "reason": self.reason,
            "isa": self.isa,
            "rtt_ms": rtt,
            "calls": self.calls,
            "pairs": self.pairs,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "compute_s": self.compute_s,
            "call_s": self.call_s,
            "failures": self.failures,
            "timeouts": self.timeouts,
            "left": self.left,
            "rejoined": self.rejoined,
        }


@dataclass
class Sent:
    """Pairs sent to peers in one go: ``tokens[i]`` (a row of the input) with expert
    ``experts[i]``; per peer, its answer and which pairs it covers."""

    tokens: np.ndarray
    experts: np.ndarray
    calls: list[tuple[PeerState, Any, np.ndarray, float, int]]
    """(peer, object ref, pair indices, send time, bytes sent)."""


class TimedAnswer(Protocol):
    """A probe's answer as :func:`_timed` makes it: a future that records when it
    arrived."""

    arrived_at: float

    def done(self) -> bool: ...
    def result(self, timeout: float | None = None) -> Any: ...


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
        """The class of the peers' Ray actors (made remote here): :class:`ExpertPeer`, or
        a subclass that answers otherwise."""
        self.num_experts = num_experts
        self.spec = spec
        ray = require_ray()
        self._started_ray = init_ray(ray, mesh.ray_address)
        self.hosts = self._placement(spec, local or {})
        """Layer -> ``[E, peers]`` bool: which peers hold each expert (hot ones: none)."""
        self.peers = self._start_peers(ray, spec)
        try:
            self.checks = {
                peer.rank: checks_of(
                    spec,
                    {
                        layer: np.flatnonzero(held[:, peer.rank])
                        for layer, held in self.hosts.items()
                    },
                    peer.rank,
                    reference,
                )
                for peer in self.peers
            }
            """Rank -> the pairs it computes to prove it works (at start, after a restart)."""
        except BaseException:
            self.close()  # (this host cannot compute the check: no peer is left running)
            raise
        self._check_at_start()
        self._pings: list[tuple[PeerState, TimedAnswer, float]] = []
        """Probes in flight: (peer, its answer as a future, send time)."""
        self._next_probe = 0.0

    @property
    def timeout_s(self) -> float:
        return self.mesh.timeout_ms / 1e3  # (``mesh`` changes with reconfigure)

    # ----------------------------------------------------------------- start

    def _placement(self, spec: ShardSpec, hot: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        peers = self.mesh.peers
        hosts = {}
        for layer in spec.layers:
            mask = np.zeros((self.num_experts, peers), dtype=bool)
            cold = np.setdiff1d(np.arange(self.num_experts), hot.get(layer, []))
            mask[cold, np.arange(len(cold)) % peers] = True  # round robin: balanced
            hosts[layer] = mask
        return hosts

    def _start_peers(self, ray: ModuleType, spec: ShardSpec) -> list[PeerState]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
        remote = ray.remote(self.peer_class)
        peers, waits = [], []
        for rank in range(self.mesh.peers):
            node = nodes[rank] if len(nodes) >= self.mesh.peers else here
            shard = ShardSpec(
                spec.checkpoint,
                {
                    layer: (name, tuple(int(e) for e in np.flatnonzero(self.hosts[layer][:, rank])))
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
            waits.append(actor.ready.remote())
        self.peers = peers  # (close() kills them on a failure below)
        for peer, wait in zip(peers, waits, strict=True):
            try:
                ready = ray.get(wait, timeout=START_TIMEOUT_S)
            except Exception as error:  # noqa: BLE001 - any failure is the same fix
                self.close()
                raise SpecExpertConfigError(
                    "mesh",
                    f"peer {peer.rank} (node {peer.node[:12]}) could not load its "
                    f"shard of {spec.checkpoint}: {first_line(error)}",
                    "put the checkpoint at the same path on every node of the Ray "
                    "cluster, with this package installed",
                ) from None
            peer.pid, peer.isa = ready["pid"], ready["isa"]
        return peers

    # ----------------------------------------------------------------- checks

    def _send_check(self, peer: PeerState) -> list:
        """The peer's check calls, as futures."""
        return [
            peer.actor.compute.remote(c.layer, c.x, c.rows, c.experts).future()
            for c in self.checks[peer.rank]
        ]

    def _check_at_start(self) -> None:
        """Every peer answers its check, or the start is refused with its reason."""
        sent = [(peer, self._send_check(peer)) for peer in self.peers]
        deadline = time.perf_counter() + START_TIMEOUT_S
        for peer, answers in sent:
            failure = check_failure(
                self.checks[peer.rank], answers, max(0.0, deadline - time.perf_counter())
            )
            if failure is not None:
                self.close()
                raise SpecExpertConfigError(
                    "mesh",
                    f"peer {peer.rank} (node {peer.node[:12]}, kernel "
                    f"{peer.isa or 'torch'}) failed its check: {failure}",
                    "give every node the same checkpoint at the same path and the same "
                    "vLLM build (the peer's own log is in Ray's session directory, "
                    "logs/worker-*.err), or remove mesh",
                )
            pairs = sum(len(c.experts) for c in self.checks[peer.rank])
            logger.info(
                "specexpert: mesh peer %d (node %s, pid %d, kernel %s) checked: "
                "%d pairs of %d layers as computed here",
                peer.rank,
                peer.node[:12],
                peer.pid,
                peer.isa or "torch",
                pairs,
                len(self.checks[peer.rank]),
            )

    # ------------------------------------------------------------- rotation

    def hosted(self, layer: int) -> np.ndarray:
        """``[E]`` experts of ``layer`` that a peer in rotation holds (probes first)."""
        self._probe()
        up = np.fromiter((p.up for p in self.peers), dtype=bool, count=len(self.peers))
        return (self.hosts[layer] & up).any(axis=1)

    def _peer_of(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """The peer in rotation that computes each expert (-1: none)."""
        up = np.fromiter((p.up for p in self.peers), dtype=bool, count=len(self.peers))
        live = self.hosts[layer][experts] & up
        return np.where(live.any(axis=1), live.argmax(axis=1), -1)

    # ----------------------------------------------------------------- calls

    def send(self, layer: int, x: torch.Tensor, tokens: np.ndarray, experts: np.ndarray) -> Sent:
        """Start computing expert ``experts[i]`` on row ``tokens[i]`` of ``x`` at the
        peers that hold them (pairs whose experts no peer in rotation holds are not
        sent: :meth:`receive` reports them failed)."""
        sent = Sent(tokens, experts, [])
        owner = self._peer_of(layer, experts)
        for rank in np.unique(owner[owner >= 0]):
            peer = self.peers[rank]
            pairs = np.flatnonzero(owner == rank)
            rows, local = np.unique(tokens[pairs], return_inverse=True)
            payload = x[torch.from_numpy(rows).to(x.device)].to("cpu").view(torch.int16).numpy()
            ref = peer.actor.compute.remote(
                layer, payload, local.astype(np.int64), experts[pairs].astype(np.int64)
            )
            sent.calls.append((peer, ref, pairs, self.clock(), payload.nbytes))
        return sent

    def receive(self, sent: Sent) -> tuple[torch.Tensor, np.ndarray]:
        """``[N, H]`` float32 outputs of the sent pairs and ``[N]`` which arrived; a
        peer that failed or did not answer within ``timeout_ms`` of the send leaves the
        rotation."""
        ray = require_ray()
        hidden = None
        done = np.zeros(len(sent.tokens), dtype=bool)
        parts = []
        for peer, ref, pairs, sent_at, nbytes in sent.calls:
            peer.calls += 1
            peer.bytes_sent += nbytes
            remaining = max(0.0, sent_at + self.timeout_s - self.clock())
            try:
                y, compute_s = ray.get(ref, timeout=remaining)
            except ray.exceptions.GetTimeoutError:
                peer.timeouts += 1
                peer.leave("hung")
                with contextlib.suppress(Exception):  # a running actor call may not cancel
                    ray.cancel(ref)
                continue
            except Exception as error:  # noqa: BLE001 - died, restarting or failed: leave
                peer.failures += 1
                peer.leave(f"failed: {first_line(error)}"[:200])
                continue
            peer.call_s += self.clock() - sent_at
            peer.compute_s += compute_s
            peer.pairs += len(pairs)
            peer.bytes_received += y.nbytes
            parts.append((pairs, y))
            done[pairs] = True
            hidden = y.shape[1]
        out = torch.zeros(len(sent.tokens), hidden or 0, dtype=torch.float32)
        for pairs, y in parts:
            out[torch.from_numpy(pairs)] = torch.from_numpy(y.copy()).view(torch.bfloat16).float()
        return out, done

    # ----------------------------------------------------------------- health

    def _probe(self) -> None:
        """Read the probes' answers that came in; send new ones when it is time."""
        now = self.clock()
        if self._pings:
            waiting = []
            for peer, answer, sent_at in self._pings:
                if answer.done():
                    self._answered(peer, answer, sent_at)
                elif now - sent_at > self.timeout_s:
                    peer.rtts.clear()
                    peer.leave("hung")
                else:
                    waiting.append((peer, answer, sent_at))
            self._pings = waiting
        if not self._pings and now >= self._next_probe:
            self._pings = [
                (peer, _timed(peer.actor.ping.remote(), self.clock), now) for peer in self.peers
            ]
            self._next_probe = now + self.mesh.probe_interval_s

    def _answered(self, peer: PeerState, answer: TimedAnswer, sent_at: float) -> None:
        try:
            pid = answer.result()
        except Exception as error:  # noqa: BLE001 - dead or restarting
            peer.rtts.clear()
            peer.leave(f"failed: {first_line(error)}"[:200])
            return
        if pid == peer.failed_pid:
            return  # this process failed its check: out until Ray restarts it
        if pid != peer.pid and peer.checking is None:
            # Ray restarted the actor: a new process, which proves itself again.
            peer.leave("restarted")
            peer.checking = (pid, self._send_check(peer))
        if peer.checking is not None:
            checked_pid, answers = peer.checking
            if not all(a.done() for a in answers):
                return
            peer.checking = None
            failure = check_failure(self.checks[peer.rank], answers)
            if failure is not None:
                peer.failed_pid, peer.reason = checked_pid, f"check: {failure}"[:200]
                logger.warning(
                    "specexpert: mesh peer %d (node %s) restarted and failed its check: %s",
                    peer.rank,
                    peer.node[:12],
                    failure,
                )
                return
            peer.pid = checked_pid
        peer.rtts.append(answer.arrived_at - sent_at)
        median = float(np.median(peer.rtts))
        if peer.up and median > self.mesh.rtt_cap_ms / 1e3:
            peer.leave("rtt")
        elif not peer.up and median <= self.mesh.rtt_cap_ms / 1e3:
            peer.rejoin()

    def stats(self) -> dict:
        return {
            "peers": [p.stats() for p in self.peers],
            "mode": self.mesh.mode,
            "placement": self.mesh.placement,
            "rtt_cap_ms": self.mesh.rtt_cap_ms,
        }

    def reset_stats(self) -> None:
        self._next_probe = 0.0  # (probe_interval_s may have changed)
        for p in self.peers:
            for name in (
                "calls",
                "pairs",
                "bytes_sent",
                "bytes_received",
                "failures",
                "timeouts",
                "left",
                "rejoined",
            ):
                setattr(p, name, 0)
            p.compute_s = p.call_s = 0.0

    def close(self) -> None:
        ray = sys.modules.get("ray")  # (at interpreter exit an import would fail)
        if ray is None:
            return
        for peer in getattr(self, "peers", []):
            with contextlib.suppress(Exception):  # already gone
                ray.kill(peer.actor)
        if self._started_ray and ray.is_initialized():
            ray.shutdown()


def _timed(ref: Any, clock: Callable[[], float]) -> TimedAnswer:
    """``ref`` as a future that records when its answer arrived (``arrived_at``, by
    ``clock``, from Ray's own thread: the round trip does not wait for the engine's next
    layer call). Done only once ``arrived_at`` is set: a reader that sees it done reads
    the time (Ray's own future is done before its callbacks run)."""
    answer: Any = Future()

    def arrived(ray_answer: Future) -> None:
        answer.arrived_at = clock()
        if ray_answer.cancelled():
            answer.cancel()
        elif (error := ray_answer.exception()) is not None:
            answer.set_exception(error)
        else:
            answer.set_result(ray_answer.result())

    ref.future().add_done_callback(arrived)
    return answer
