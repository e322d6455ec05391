"""The places an expert entry can run besides the device slots, behind one protocol: the
host (:class:`~vllm_specexpert.tiers.host.HostExperts`), an expert's INT4 copy in the
layer's low-bit slots, and a mesh peer (:class:`~vllm_specexpert.peers.layer_view.LayerPeers`).

The :class:`~vllm_specexpert.policy.MissPlan` gives each its entries; the executor
(:func:`vllm_specexpert.execute.execute`) stages them all before the device kernel, then
adds each backend's results in :data:`ORDER`. Entries a backend could not compute (a
peer that left the rotation) run on the device.
"""

from __future__ import annotations

import time
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.peers.layer_view import LayerPeers
from vllm_specexpert.policy import MissContext, MissPlan
from vllm_specexpert.stats import PhaseStats
from vllm_specexpert.tiers.host import HostExperts
from vllm_specexpert.tiers.loader import ExpertLoader

T = TypeVar("T")


class Backend(Protocol):
    """A place where entries of a layer call run."""

    def stage(self, call: LayerCall, entries: np.ndarray) -> Any:
        """Start the ``[T, K]`` ``entries`` of ``call`` (the plan's routing and weights),
        before the device kernel: what :meth:`finish` needs."""

    def finish(self, job: Any, out: torch.Tensor) -> np.ndarray | None:
        """Add the weighted outputs to ``out``; returns the entries not computed, if any."""


class LowBitBackend:
    """Entries run from their expert's INT4 copy, loaded (packed) into the layer's
    low-bit slots: one kernel launch on those slots. Its loads count as ``low_bit_*``
    (and in ``bytes_loaded``), not as the cache's."""

    def __init__(self, loader: ExpertLoader):
        self.loader = loader

    def stage(self, call: LayerCall, entries: np.ndarray) -> tuple[LayerCall, np.ndarray]:
        return call, entries  # runs in finish: it shares the device with the kernel

    def finish(self, job: tuple[LayerCall, np.ndarray], out: torch.Tensor) -> None:
        call, entries = job
        ids, stats, low_bit = call.host_ids, call.stats, self.loader
        scratch = PhaseStats()
        low_bit.acquire(np.unique(ids[entries]), scratch)  # demand copies count at once
        stats.low_bit_loads += scratch.loads
        stats.low_bit_bytes += scratch.bytes_loaded
        stats.bytes_loaded += scratch.bytes_loaded
        stats.stall_s += scratch.stall_s
        index, part = call.masked(entries)
        kernel_ids, expert_map = low_bit.cache.kernel_routing(part.topk_ids, part.host_ids)
        out[index] += part.kernel(
            part.x, part.topk_weights, kernel_ids, low_bit.cache.slots, expert_map
        )
        low_bit.kernel_launched(np.unique(ids[entries]))
        stats.kernel_calls += 1
        return None


class PeerBackend:
    """Entries computed by the mesh peers that hold their experts; pairs fired ahead
    (Early Fire, :attr:`LayerPeers.fired`) are taken from what was sent then."""

    def __init__(self, peers: LayerPeers):
        self.peers = peers

    def stage(self, call: LayerCall, entries: np.ndarray) -> tuple[LayerCall, Any]:
        return call, self.peers.stage(call.x, call.host_ids, entries)

    def finish(self, job: tuple[LayerCall, Any], out: torch.Tensor) -> np.ndarray:
        call, staged = job
        waited_from = time.perf_counter()
        call.stats.fired_used += staged.reused
        failed = self.peers.finish(staged, out, call.topk_weights, call.host_ids.shape)
        call.stats.peer_wait_s += time.perf_counter() - waited_from
        return failed


class HostBackend:
    """Entries computed on the host from the slow tier, while the device runs its own."""

    def __init__(self, host: HostExperts):
        self.host = host

    def stage(self, call: LayerCall, entries: np.ndarray) -> tuple[LayerCall, Any, float]:
        return (
            call,
            self.host.stage(call.x, call.topk_weights, call.host_ids, entries),
            time.perf_counter(),
        )

    def finish(self, job: tuple[LayerCall, Any, float], out: torch.Tensor) -> None:
        call, staged, started_at = job
        charged, waited = self.host.finish(staged, out, started_at)
        call.stats.host_experts += staged.experts
        call.stats.host_s += charged
        call.stats.host_stall_s += waited
        return None


def placements(plan: MissPlan, context: MissContext) -> list[tuple[Backend, np.ndarray]]:
    """The backends ``plan`` gives entries to, with their entries, in the order they
    finish (INT4 copies, peers, host: the order their outputs are added)."""
    chosen: list[tuple[Backend, np.ndarray]] = []
    if plan.low_bit is not None and plan.low_bit.any():
        chosen.append((LowBitBackend(_present(context.low_bit, "INT4 copies")), plan.low_bit))
    if plan.on_peer is not None and plan.on_peer.any():
        chosen.append((PeerBackend(_present(context.peers, "peers")), plan.on_peer))
    if plan.on_host is not None and plan.on_host.any():
        chosen.append((HostBackend(_present(context.host, "host compute")), plan.on_host))
    return chosen


def _present(place: T | None, what: str) -> T:
    """A policy gives entries only to the places its layer's context has."""
    if place is None:
        raise RuntimeError(f"a miss plan gave entries to {what}, which the layer lacks")
    return place
