"""The mesh peers' health: probes, leaving the rotation and rejoining it.

Every ``mesh.probe_interval_s`` the engine pings every peer, without blocking: each layer
call looks at the answers that came in. A peer whose median round trip exceeds
``mesh.rtt_cap_ms``, or whose ping fails or outlasts ``mesh.timeout_ms``, leaves the
rotation; one out of it that answers under the cap rejoins (Ray restarts a dead actor,
``max_restarts=-1``, which reloads its shard). A restarted actor (a new process id)
answers its check (:mod:`.check`) again before it rejoins. A ping's arrival time is taken
by a callback on Ray's thread (read at the next layer call, a round trip would include
that call's own wait). Pings are sent from the engine's thread: a prober thread's
``ray.get`` stalled while the worker waited on peers. Experts of peers out of rotation
are not remote: the miss policy serves them from the local slow tier.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from vllm_specexpert.config.sections import MeshConfig
from vllm_specexpert.log import init_logger
from vllm_specexpert.peers.calls import answer_timeout_s
from vllm_specexpert.peers.check import PeerCheck, check_failure, send_check
from vllm_specexpert.peers.peer_state import PeerState
from vllm_specexpert.peers.ray_cluster import first_line

logger = init_logger(__name__)


class TimedAnswer(Protocol):
    """A probe's answer as :func:`timed` makes it: a future that records when it
    arrived."""

    arrived_at: float

    def done(self) -> bool: ...
    def result(self, timeout: float | None = None) -> Any: ...


class Prober:
    """Probes the peers from the engine's thread and moves them out of the rotation and
    back (module doc)."""

    def __init__(self, peers: list[PeerState], checks: dict[int, list[PeerCheck]]) -> None:
        self.peers = peers
        self.checks = checks
        """Rank -> the pairs a restarted peer computes before it rejoins."""
        self.pings: list[tuple[PeerState, TimedAnswer, float]] = []
        """Probes in flight: (peer, its answer as a future, send time)."""
        self._next_probe = 0.0

    def probe_at_next_call(self) -> None:
        """The next :meth:`probe` sends probes whatever the time (``probe_interval_s``
        may have changed)."""
        self._next_probe = 0.0

    def probe(self, mesh: MeshConfig, clock: Callable[[], float]) -> None:
        """Read the probes' answers that came in; send new ones when it is time."""
        now = clock()
        if self.pings:
            waiting = []
            for peer, answer, sent_at in self.pings:
                if answer.done():
                    self._answered(peer, answer, sent_at, mesh)
                elif now - sent_at > answer_timeout_s(mesh):
                    peer.rtts.clear()
                    peer.leave("hung")
                else:
                    waiting.append((peer, answer, sent_at))
            self.pings = waiting
        if not self.pings and now >= self._next_probe:
            self.pings = [
                (peer, timed(peer.actor.ping.remote(), clock), now) for peer in self.peers
            ]
            self._next_probe = now + mesh.probe_interval_s

    def _answered(
        self, peer: PeerState, answer: TimedAnswer, sent_at: float, mesh: MeshConfig
    ) -> None:
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
            peer.checking = (pid, send_check(peer.actor, self.checks[peer.rank]))
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
        if peer.up and median > mesh.rtt_cap_ms / 1e3:
            peer.leave("rtt")
        elif not peer.up and median <= mesh.rtt_cap_ms / 1e3:
            peer.rejoin()


def timed(ref: Any, clock: Callable[[], float]) -> TimedAnswer:
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
