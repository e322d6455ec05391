"""Calls to the mesh's peers: a layer's rows and the (row, expert) pairs to compute sent
to the peers in rotation that hold the experts, and their unweighted outputs received.

Faults: a call that raises (the actor died) or outlasts ``mesh.timeout_ms`` (hung) takes
its peer out of the rotation (logged once, a warning naming the peer and the reason), and
its pairs are reported not done: the engine computes them locally.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_specexpert.config.sections import MeshConfig
from vllm_specexpert.peers.peer_state import PeerState, in_rotation
from vllm_specexpert.peers.ray_cluster import first_line, require_ray


@dataclass
class Sent:
    """Pairs sent to peers in one go: ``tokens[i]`` (a row of the input) with expert
    ``experts[i]``; per peer, its answer and which pairs it covers."""

    tokens: np.ndarray
    experts: np.ndarray
    calls: list[tuple[PeerState, Any, np.ndarray, float, int]]
    """(peer, object ref, pair indices, send time, bytes sent)."""


def answer_timeout_s(mesh: MeshConfig) -> float:
    """How long a call or a probe waits for a peer's answer (``mesh`` changes with
    reconfigure: read at each use)."""
    return mesh.timeout_ms / 1e3


def send(
    peers: list[PeerState],
    held: np.ndarray,
    layer: int,
    x: torch.Tensor,
    tokens: np.ndarray,
    experts: np.ndarray,
    clock: Callable[[], float],
) -> Sent:
    """Start computing expert ``experts[i]`` on row ``tokens[i]`` of ``x`` at the
    ``peers`` in rotation that hold them (``held``: ``[E, peers]``, of ``layer``); pairs
    whose experts none of them holds are not sent (:func:`receive` reports them failed)."""
    sent = Sent(tokens, experts, [])
    owner = _owners(peers, held, experts)
    for rank in np.unique(owner[owner >= 0]):
        peer = peers[rank]
        pairs = np.flatnonzero(owner == rank)
        rows, local = np.unique(tokens[pairs], return_inverse=True)
        payload = x[torch.from_numpy(rows).to(x.device)].to("cpu").view(torch.int16).numpy()
        ref = peer.actor.compute.remote(
            layer, payload, local.astype(np.int64), experts[pairs].astype(np.int64)
        )
        sent.calls.append((peer, ref, pairs, clock(), payload.nbytes))
    return sent


def _owners(peers: list[PeerState], held: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """The peer in rotation that computes each expert (-1: none)."""
    live = held[experts] & in_rotation(peers)
    return np.where(live.any(axis=1), live.argmax(axis=1), -1)


def receive(
    sent: Sent, timeout_s: float, clock: Callable[[], float]
) -> tuple[torch.Tensor, np.ndarray]:
    """``[N, H]`` float32 outputs of the sent pairs and ``[N]`` which arrived; a
    peer that failed or did not answer within ``timeout_s`` of the send leaves the
    rotation."""
    ray = require_ray()
    hidden = None
    done = np.zeros(len(sent.tokens), dtype=bool)
    parts = []
    for peer, ref, pairs, sent_at, nbytes in sent.calls:
        peer.calls += 1
        peer.bytes_sent += nbytes
        remaining = max(0.0, sent_at + timeout_s - clock())
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
        peer.call_s += clock() - sent_at
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
