"""The miss-policy interface: what a layer does with routed experts that are not resident.

Per decode call a policy returns a :class:`MissPlan` (per (token, k) entry: device,
substitute, host, INT4 copy or drop), which :mod:`vllm_specexpert.execute` carries out.
No plan means load what is missing (``fetch``, bit-exact). Prefill never reaches a
policy. Traits (``spec``) come from :data:`~vllm_specexpert.config.modes.MISS_POLICIES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from vllm_specexpert.config.modes import MISS_POLICIES, MissPolicySpec
from vllm_specexpert.policy.context import MissContext
from vllm_specexpert.stats import PhaseStats


@dataclass
class MissPlan:
    """How one layer call resolves its routing. Masks are ``[T, K]`` over entries; an
    entry in none of them runs on the device (loaded if missing)."""

    topk_ids: np.ndarray
    """Expert ids to run: the router's, with substitutes in place."""
    substituted: np.ndarray | None = None
    """Entries whose expert was replaced by a resident one (weight kept)."""
    on_host: np.ndarray | None = None
    """Entries computed on the host from the slow tier."""
    dropped: np.ndarray | None = None
    """Entries not run at all."""
    low_bit: np.ndarray | None = None
    """Entries run from their expert's INT4 copy in the layer's low-bit slots."""
    on_peer: np.ndarray | None = None
    """Entries computed by the mesh peer holding their expert (:class:`~vllm_specexpert.
    policy.peers.PeersFirst`)."""
    renormalize: bool = False
    """Scale each token's remaining weights so they sum to what all its weights did."""

    def count(self, stats: PhaseStats) -> None:
        """Add the plan's entries per kind to a phase's counters."""
        for mask, counter in (
            (self.substituted, "substituted_entries"),
            (self.dropped, "dropped_entries"),
            (self.on_host, "host_entries"),
            (self.low_bit, "low_bit_entries"),
            (self.on_peer, "peer_entries"),
        ):
            if mask is not None:
                setattr(stats, counter, getattr(stats, counter) + int(np.count_nonzero(mask)))

    def computed_elsewhere(self) -> np.ndarray:
        """``[T, K]`` entries computed off the device's cache: on the host or from an
        INT4 copy (what ``admit_host_experts`` may load)."""
        none = np.zeros(self.topk_ids.shape, dtype=bool)
        return (self.on_host if self.on_host is not None else none) | (
            self.low_bit if self.low_bit is not None else none
        )


class MissPolicy:
    """Decides, per decode call of one MoE layer, what happens to missing experts."""

    spec: ClassVar[MissPolicySpec] = MISS_POLICIES["fetch"]
    """The policy's traits (:mod:`vllm_specexpert.config.modes`), by its config name."""

    @property
    def name(self) -> str:
        return self.spec.name

    def plan(
        self,
        ids: np.ndarray,
        resident: np.ndarray,
        topk_weights: torch.Tensor,
        context: MissContext,
    ) -> MissPlan | None:
        """Decide about the entries of ``ids`` ([T, K]) not ``resident`` ([E]; at least
        one). ``None``: load them (``fetch``)."""
        return None
