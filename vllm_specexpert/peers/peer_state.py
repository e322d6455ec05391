"""One mesh peer as the engine sees it: its Ray actor, whether it is in the rotation (and
why not), the process that proved it computes, its probe round trips, and its counters
(its entry of the stats' ``mesh.peers``). :mod:`.calls` counts its calls and
:mod:`.health` its probes; both take it out of the rotation, only a probe brings it back."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_specexpert.log import init_logger
from vllm_specexpert.stats import Counters, counter, seconds

logger = init_logger(__name__)

RTT_WINDOW = 5
"""Probe round trips a peer's RTT is the median of."""


@dataclass
class PeerState(Counters):
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
    :func:`~.check.send_check`."""
    failed_pid: int = 0
    """The process id of an actor that failed its check (out until it restarts)."""
    rtts: deque = field(default_factory=lambda: deque(maxlen=RTT_WINDOW))
    calls: int = counter("Calls answered by the peer.")
    pairs: int = counter("(token, expert) pairs it computed.")
    bytes_sent: int = counter("Bytes of rows sent to it.")
    bytes_received: int = counter("Bytes of outputs it sent.")
    compute_s: float = seconds("Seconds it spent computing.")
    call_s: float = seconds(
        "Seconds from send to answer, summed (includes the engine's own work meanwhile)."
    )
    failures: int = counter("Calls that failed (it died).")
    timeouts: int = counter("Calls not answered within mesh.timeout_ms.")
    left: int = counter("Times it left the rotation.")
    rejoined: int = counter("Times it rejoined the rotation.")

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
            **self.to_dict(),
        }


def in_rotation(peers: Sequence[PeerState]) -> np.ndarray:
    """``[peers]`` bool: which of ``peers`` are in the rotation."""
    return np.fromiter((p.up for p in peers), dtype=bool, count=len(peers))
