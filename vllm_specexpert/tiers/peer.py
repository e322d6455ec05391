"""The peer tier (``mesh``): experts held and computed by Ray actors on other nodes.

A peer's "copy" is a remote computation: the engine sends a layer's rows and the
(row, expert) pairs to compute, the peer (:class:`~.peer_shard.ExpertPeer`) answers with
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
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.config.sections import MeshConfig
from vllm_specexpert.log import init_logger
from vllm_specexpert.tiers.peer_shard import ExpertPeer, ShardSpec
from vllm_specexpert.tiers.ray_cluster import first_line, init_ray, require_ray

logger = init_logger(__name__)

START_TIMEOUT_S = 300.0
"""How long the engine waits at start for every peer to load its shard (and, again,
to answer its check)."""
RTT_WINDOW = 5
"""Probe round trips a peer's RTT is the median of."""
CHECK_ROWS = 4
"""Rows of a peer's check, each computed by two of its experts per layer."""
CHECK_TOLERANCE = 0.02
"""Largest relative error (per pair, in the L2 norm) of a peer's check against this
host's result. One kernel gives the same bits; vLLM's portable and AMX kernels differ
by bf16 rounding (well under 1 %); other weights give errors of order 1."""

PairReference = Callable[[int, torch.Tensor, np.ndarray], torch.Tensor]
"""``reference(layer, x, experts) -> [N, H]``: expert ``experts[i]`` of decoder layer
``layer`` on row ``i`` of ``x`` (``[N, H]``), unweighted, computed on this host."""


@dataclass
class PeerState:
    """One peer: its actor, whether it is in rotation, and its counters."""

    rank: int
    actor: object
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
            logger.warning("specexpert: mesh peer %d (node %s) left the rotation: %s; its "
                           "experts are computed here until it answers probes again",
                           self.rank, self.node[:12], reason)

    def rejoin(self) -> None:
        self.up, self.reason = True, ""
        self.rejoined += 1
        logger.info("specexpert: mesh peer %d (node %s) is back in rotation",
                    self.rank, self.node[:12])

    def stats(self) -> dict:
        rtt = float(np.median(self.rtts)) * 1e3 if self.rtts else None
        return {"rank": self.rank, "node": self.node, "up": self.up, "reason": self.reason,
                "isa": self.isa, "rtt_ms": rtt, "calls": self.calls, "pairs": self.pairs,
                "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "compute_s": self.compute_s, "call_s": self.call_s,
                "failures": self.failures, "timeouts": self.timeouts, "left": self.left,
                "rejoined": self.rejoined}


@dataclass
class Sent:
    """Pairs sent to peers in one go: ``tokens[i]`` (a row of the input) with expert
    ``experts[i]``; per peer, its answer and which pairs it covers."""

    tokens: np.ndarray
    experts: np.ndarray
    calls: list[tuple[PeerState, object, np.ndarray, float, int]]
    """(peer, object ref, pair indices, send time, bytes sent)."""


@dataclass
class PeerCheck:
    """Pairs of one layer that a peer computes to prove it works, and this host's
    result of them."""

    layer: int
    x: np.ndarray
    """``[CHECK_ROWS, H]`` bf16 as int16 (the wire form of :meth:`ExpertPeer.compute`)."""
    rows: np.ndarray
    experts: np.ndarray
    expected: torch.Tensor
    """``[N, H]`` float32: ``reference`` of the pairs."""

    def error(self, y: np.ndarray) -> float:
        """The largest relative error of a peer's answer ``y`` over the pairs."""
        got = torch.from_numpy(np.array(y)).view(torch.bfloat16).float()  # (a read-only view)
        if got.shape != self.expected.shape:
            return float("inf")
        scale = self.expected.norm(dim=1).clamp_min(1e-6)
        return float(((got - self.expected).norm(dim=1) / scale).max())


class PeerTier:
    """The engine's side of the mesh: placement, checks, calls, health (module doc)."""

    def __init__(self, mesh: MeshConfig, spec: ShardSpec, num_experts: int,
                 reference: PairReference, local: dict[int, np.ndarray] | None = None):
        self.mesh = mesh
        self.num_experts = num_experts
        self.spec = spec
        ray = require_ray()
        self._started_ray = init_ray(ray, mesh.ray_address)
        self.hosts = self._placement(spec, local or {})
        """Layer -> ``[E, peers]`` bool: which peers hold each expert (hot ones: none)."""
        self.peers = self._start_peers(ray, spec)
        self.checks = {peer.rank: self._checks_of(peer.rank, reference)
                       for peer in self.peers}
        """Rank -> the pairs it computes to prove it works (at start, after a restart)."""
        self._check_at_start()
        self._pings: list[tuple[PeerState, object, float]] = []
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

    def _start_peers(self, ray, spec: ShardSpec) -> list[PeerState]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
        remote = ray.remote(ExpertPeer)
        peers, waits = [], []
        for rank in range(self.mesh.peers):
            node = nodes[rank] if len(nodes) >= self.mesh.peers else here
            shard = ShardSpec(spec.checkpoint, {
                layer: (name, tuple(int(e) for e in np.flatnonzero(self.hosts[layer][:, rank])))
                for layer, (name, _) in spec.layers.items()}, spec.w13_shape, spec.isa,
                spec.activation)
            actor = remote.options(
                num_cpus=0, max_restarts=-1, max_task_retries=0, max_concurrency=2,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote(rank, shard)
            peers.append(PeerState(rank=rank, actor=actor, node=node))
            waits.append(actor.ready.remote())
        self.peers = peers  # (close() kills them on a failure below)
        for peer, wait in zip(peers, waits):
            try:
                ready = ray.get(wait, timeout=START_TIMEOUT_S)
            except Exception as error:  # noqa: BLE001 - any failure is the same fix
                self.close()
                raise SpecExpertConfigError(
                    "mesh", f"peer {peer.rank} (node {peer.node[:12]}) could not load its "
                    f"shard of {spec.checkpoint}: {first_line(error)}",
                    "put the checkpoint at the same path on every node of the Ray "
                    "cluster, with this package installed") from None
            peer.pid, peer.isa = ready["pid"], ready["isa"]
        return peers

    # ----------------------------------------------------------------- checks

    def _checks_of(self, rank: int, reference: PairReference) -> list[PeerCheck]:
        """Per layer, :data:`CHECK_ROWS` rows by the first and last expert ``rank``
        holds there, and ``reference``'s result of those pairs."""
        hidden = self.spec.w13_shape[1]
        generator = torch.Generator().manual_seed(rank)
        checks = []
        for layer in self.spec.layers:
            held = np.flatnonzero(self.hosts[layer][:, rank])
            if not len(held):
                continue
            experts = np.unique(held[[0, -1]])
            x = torch.randn(CHECK_ROWS, hidden, generator=generator).to(torch.bfloat16)
            rows = np.repeat(np.arange(CHECK_ROWS), len(experts))
            pairs = np.tile(experts, CHECK_ROWS)
            expected = reference(layer, x[torch.from_numpy(rows)], pairs).float()
            checks.append(PeerCheck(layer, x.view(torch.int16).numpy(), rows, pairs,
                                    expected))
        return checks

    def _send_check(self, peer: PeerState) -> list:
        """The peer's check calls, as futures."""
        return [peer.actor.compute.remote(c.layer, c.x, c.rows, c.experts).future()
                for c in self.checks[peer.rank]]

    def _check_failure(self, peer: PeerState, answers: list, timeout: float | None = None
                       ) -> str | None:
        """Why the peer's check ``answers`` (futures of :meth:`_send_check`) fail, or
        ``None`` when every pair matches this host's."""
        for check, answer in zip(self.checks[peer.rank], answers):
            try:
                y, _ = answer.result(timeout=timeout)
            except Exception as error:  # noqa: BLE001 - died, timed out or raised
                return f"computing layer {check.layer}: {first_line(error)}"
            error = check.error(y)
            if not error <= CHECK_TOLERANCE:
                return (f"its experts {sorted(set(check.experts.tolist()))} of layer "
                        f"{check.layer} differ from this host's (relative error "
                        f"{error:.3g} > {CHECK_TOLERANCE})")
        return None

    def _check_at_start(self) -> None:
        """Every peer answers its check, or the start is refused with its reason."""
        sent = [(peer, self._send_check(peer)) for peer in self.peers]
        deadline = time.perf_counter() + START_TIMEOUT_S
        for peer, answers in sent:
            failure = self._check_failure(peer, answers,
                                          max(0.0, deadline - time.perf_counter()))
            if failure is not None:
                self.close()
                raise SpecExpertConfigError(
                    "mesh", f"peer {peer.rank} (node {peer.node[:12]}, kernel "
                    f"{peer.isa or 'torch'}) failed its check: {failure}",
                    "give every node the same checkpoint at the same path and the same "
                    "vLLM build (the peer's own log is in Ray's session directory, "
                    "logs/worker-*.err), or remove mesh")
            pairs = sum(len(c.experts) for c in self.checks[peer.rank])
            logger.info("specexpert: mesh peer %d (node %s, pid %d, kernel %s) checked: "
                        "%d pairs of %d layers as computed here", peer.rank,
                        peer.node[:12], peer.pid, peer.isa or "torch", pairs,
                        len(self.checks[peer.rank]))

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

    def send(self, layer: int, x: torch.Tensor, tokens: np.ndarray,
             experts: np.ndarray) -> Sent:
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
            ref = peer.actor.compute.remote(layer, payload, local.astype(np.int64),
                                            experts[pairs].astype(np.int64))
            sent.calls.append((peer, ref, pairs, time.perf_counter(), payload.nbytes))
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
            remaining = max(0.0, sent_at + self.timeout_s - time.perf_counter())
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
            peer.call_s += time.perf_counter() - sent_at
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
        now = time.perf_counter()
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
            self._pings = [(peer, _timed(peer.actor.ping.remote()), now) for peer in self.peers]
            self._next_probe = now + self.mesh.probe_interval_s

    def _answered(self, peer: PeerState, answer, sent_at: float) -> None:
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
            failure = self._check_failure(peer, answers)
            if failure is not None:
                peer.failed_pid, peer.reason = checked_pid, f"check: {failure}"[:200]
                logger.warning("specexpert: mesh peer %d (node %s) restarted and failed "
                               "its check: %s", peer.rank, peer.node[:12], failure)
                return
            peer.pid = checked_pid
        peer.rtts.append(answer.arrived_at - sent_at)
        median = float(np.median(peer.rtts))
        if peer.up and median > self.mesh.rtt_cap_ms / 1e3:
            peer.leave("rtt")
        elif not peer.up and median <= self.mesh.rtt_cap_ms / 1e3:
            peer.rejoin()

    def stats(self) -> dict:
        return {"peers": [p.stats() for p in self.peers], "mode": self.mesh.mode,
                "placement": self.mesh.placement, "rtt_cap_ms": self.mesh.rtt_cap_ms}

    def reset_stats(self) -> None:
        self._next_probe = 0.0  # (probe_interval_s may have changed)
        for p in self.peers:
            for name in ("calls", "pairs", "bytes_sent", "bytes_received", "failures",
                         "timeouts", "left", "rejoined"):
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


def _timed(ref):
    """``ref`` as a future that records when its answer arrived (``arrived_at``), from
    Ray's own thread: the round trip does not wait for the engine's next layer call."""
    answer = ref.future()

    def arrived(_future) -> None:
        answer.arrived_at = time.perf_counter()

    answer.add_done_callback(arrived)
    return answer


@dataclass
class PeerJob:
    """One layer call's entries computed by peers: where each one's answer comes from."""

    sources: list[tuple[Sent, np.ndarray, np.ndarray, np.ndarray]]
    """(what was sent, entry rows, entry columns, the pair index of each entry)."""
    reused: int = 0
    """Entries taken from what was fired ahead (Early Fire's hits)."""


@dataclass
class LayerPeers:
    """One layer's view of the peer tier: what its executor and planners call."""

    tier: PeerTier
    layer: int
    """Decoder-layer index."""

    def hosted(self) -> np.ndarray:
        return self.tier.hosted(self.layer)

    def send(self, x: torch.Tensor, tokens: np.ndarray, experts: np.ndarray) -> Sent:
        return self.tier.send(self.layer, x, tokens, experts)

    def stage(self, x: torch.Tensor, ids: np.ndarray, entries: np.ndarray,
              fired: Sent | None = None) -> PeerJob:
        """Send the ``entries`` ([T, K] mask over ``ids``) of rows ``x``, taking those
        whose (row, expert) pair was ``fired`` ahead from there instead."""
        rows, cols = np.nonzero(entries)
        job = PeerJob([])
        if fired is not None and len(fired.tokens):
            num = max(int(ids.max()), int(fired.experts.max())) + 1
            keys = fired.tokens * num + fired.experts
            order = np.argsort(keys, kind="stable")
            wanted = rows * num + ids[rows, cols]
            at = np.minimum(np.searchsorted(keys[order], wanted), len(keys) - 1)
            hit = keys[order][at] == wanted
            if hit.any():
                job.sources.append((fired, rows[hit], cols[hit], order[at][hit]))
            job.reused = int(hit.sum())
            rows, cols = rows[~hit], cols[~hit]
        if len(rows):
            sent = self.send(x, rows, ids[rows, cols])
            job.sources.append((sent, rows, cols, np.arange(len(rows))))
        return job

    def finish(self, job: PeerJob, out: torch.Tensor, weights: torch.Tensor,
               shape: tuple[int, int]) -> np.ndarray:
        """Add the job's answers, times the entries' ``weights`` ([T, K]), to ``out``;
        return the ``[T, K]`` mask of entries no peer answered."""
        failed = np.zeros(shape, dtype=bool)
        acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
        for sent, rows, cols, pairs in job.sources:
            y, done = self.tier.receive(sent)
            ok = done[pairs]
            failed[rows[~ok], cols[~ok]] = True
            if ok.any():
                r, c = (torch.from_numpy(a[ok]).to(out.device) for a in (rows, cols))
                acc.index_add_(0, r, y[torch.from_numpy(pairs[ok])].to(out.device)
                               * weights[r, c].float()[:, None])
        out.copy_((out.float() + acc).to(out.dtype))
        return failed
