"""What a miss policy may consult about one layer besides its cache, and how it is built
from the config and the calibration."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.peers.layer_view import LayerPeers
from vllm_specexpert.policy.buddies import BuddyGates, buddy_lists
from vllm_specexpert.tiers.host import HostExperts, HostKernel
from vllm_specexpert.tiers.loader import ExpertLoader
from vllm_specexpert.tiers.store import ExpertSource, LayerExperts


@dataclass
class MissContext:
    """What a policy may consult about one layer, besides its cache."""

    expert_copy_seconds: Callable[[], float]
    """Expected link seconds of one expert, asked when needed (the estimate may change)."""
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
) -> MissContext:
    """A layer's context under ``config``'s miss policy, from the layer alone; features add
    the rest (their checks at engine start refuse a policy whose part is missing)."""
    policy = config.miss_policy_spec
    context = MissContext(expert_copy_seconds)
    if policy.computes_on_host or policy.low_bit:
        context.admit_host_experts = config.admit_host_experts
    # (host compute reads the experts where they are: in host memory)
    if policy.computes_on_host and host_kernel is not None and isinstance(experts, LayerExperts):
        link = config.link
        context.host = HostExperts(
            experts, host_kernel, link.host_slowdown if link.emulated else None
        )
    buddy = config.buddy
    if policy.substitutes and buddy.tau is not None:  # (else the calibration's percentile)
        context.gates = BuddyGates(tau=buddy.tau, beta=buddy.beta, rho=buddy.rho)
    return context


def add_routing_statistics(
    context: MissContext,
    config: SpecExpertConfig,
    coactivation: np.ndarray,
    tae_percentiles: np.ndarray,
) -> None:
    """Buddy lists and, unless configured, tau from a layer's calibrated co-activation
    counts and TAE percentiles."""
    buddy = config.buddy
    if config.miss_policy_spec.uses_buddy_lists:
        context.buddies = buddy_lists(coactivation, buddy.alpha, buddy.k_max)
    tau = buddy.tau
    if tau is None:
        tau = float(np.interp(buddy.tau_percentile, np.linspace(0, 100, 101), tae_percentiles))
    context.gates = BuddyGates(tau=tau, beta=buddy.beta, rho=buddy.rho)
