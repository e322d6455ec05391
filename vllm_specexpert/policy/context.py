"""What a miss policy may consult about one layer besides its cache, and how it is built
from the config and the calibration."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.policy.buddies import BuddyGates, buddy_lists
from vllm_specexpert.tiers.host import HostExperts, HostKernel
from vllm_specexpert.tiers.layer_peers import LayerPeers
from vllm_specexpert.tiers.loader import ExpertLoader
from vllm_specexpert.tiers.store import ExpertSource, LayerExperts


@dataclass
class MissContext:
    """What a policy may consult about one layer, besides its cache."""

    expert_copy_seconds: Callable[[], float]
    """Expected link time of one of the layer's experts, asked when a plan needs it (a
    link's estimate may follow what it measures)."""
    host: HostExperts | None = None
    """Host compute of the layer's experts (``cpu``, ``auto``)."""
    buddies: np.ndarray | None = None
    """``[E, K_max]`` buddy lists, best first, -1 padded (``buddy``, ``auto_buddy``)."""
    gates: BuddyGates | None = None
    """Substitution gates with this layer's tau."""
    admit_host_experts: bool = False
    """Load the most-used expert computed elsewhere (host, INT4 copy) in the background
    on an idle link."""
    low_bit: ExpertLoader | None = None
    """The layer's low-bit slots and their loader (``lowbit``)."""
    peers: LayerPeers | None = None
    """The mesh peers that hold this layer's experts (``mesh``)."""
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    """Randomness of the ``random`` baseline (seeded: runs are repeatable)."""

    @property
    def copy_seconds(self) -> float:
        return self.expert_copy_seconds()


def miss_context(
    config: SpecExpertConfig,
    experts: ExpertSource,
    expert_copy_seconds: Callable[[], float],
    host_kernel: HostKernel | None = None,
    coactivation: np.ndarray | None = None,
    tae_percentiles: np.ndarray | None = None,
    low_bit: ExpertLoader | None = None,
    peers: LayerPeers | None = None,
) -> MissContext | None:
    """A layer's context under ``config``'s miss policy; ``None`` while something it
    needs is missing (a host kernel, the calibration's routing statistics: the engine
    reports it when it starts)."""
    policy = config.miss_policy_spec
    context = MissContext(expert_copy_seconds, peers=peers)
    if policy.computes_on_host:
        if host_kernel is None or not isinstance(experts, LayerExperts):
            return None  # (host compute reads the experts where they are: in host memory)
        link = config.link
        context.host = HostExperts(
            experts, host_kernel, link.host_slowdown if link.emulated else None
        )
        context.admit_host_experts = config.admit_host_experts
    if policy.low_bit:
        if low_bit is None:
            return None
        context.low_bit = low_bit
        context.admit_host_experts = config.admit_host_experts
    if policy.substitutes:
        buddy = config.buddy
        tau = buddy.tau
        if config.routing_statistics_need is not None:
            if coactivation is None:
                return None
            if policy.uses_buddy_lists:
                context.buddies = buddy_lists(coactivation, buddy.alpha, buddy.k_max)
            if tau is None:
                assert tae_percentiles is not None  # the calibration's, with coactivation
                tau = float(
                    np.interp(buddy.tau_percentile, np.linspace(0, 100, 101), tae_percentiles)
                )
        assert tau is not None  # unset tau is a routing-statistics need: chosen above
        context.gates = BuddyGates(tau=tau, beta=buddy.beta, rho=buddy.rho)
    return context
