"""The miss-policy interface: what a layer does with routed experts that are not resident.

A policy decides; :mod:`vllm_specexpert.policy.executor` carries the decision out. Per
decode call the policy looks at the routing against the cache and returns a
:class:`MissPlan`: per (token, k) entry, run it on the device (resident, or loaded on
demand), substitute another expert for it, compute it on the host, or drop it. No plan
means "load what is missing and run the router's routing" (``fetch``, the bit-exact path).
Prefill tokens never reach a policy: they always run exactly (see the engine).

Each policy class is the one source of its traits (class attributes below): config
validation, the engine and the stats read them from the class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
import torch

from vllm_specexpert.host import HostExperts
from vllm_specexpert.policy.buddies import BuddyGates
from vllm_specexpert.predict import Prediction

if TYPE_CHECKING:
    from vllm_specexpert.config import SpecExpertConfig

Output = Literal["exact", "equivalent", "approximate"]


@dataclass
class MissContext:
    """What a policy may consult about one layer, besides its cache."""

    copy_seconds: float
    """Expected link time of one of the layer's experts."""
    host: HostExperts | None = None
    """Host compute of the layer's experts (``cpu``, ``auto``)."""
    buddies: np.ndarray | None = None
    """``[E, K_max]`` buddy lists, best first, -1 padded (``buddy``, ``auto_buddy``)."""
    gates: BuddyGates | None = None
    """Substitution gates with this layer's tau."""
    admit_host_experts: bool = False
    """Load the most-used host-computed expert in the background on an idle link."""
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    """Randomness of the ``random`` baseline (seeded: runs are repeatable)."""


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
    renormalize: bool = False
    """Scale each token's remaining weights so they sum to what all its weights did."""


class MissPolicy:
    """Decides, per decode call of one MoE layer, what happens to missing experts."""

    name: ClassVar[str] = "fetch"
    output: ClassVar[Output] = "exact"
    """What the policy does to the model's output: ``exact`` (bit-identical to vanilla
    vLLM), ``equivalent`` (the same experts and weights, summed in another order: equal
    up to rounding) or ``approximate`` (other experts or weights run: the output
    changes)."""
    needs_predictor: ClassVar[bool] = False
    """Whether it runs predictions (a ``predictor`` other than ``none`` is required)."""
    speculates: ClassVar[bool] = False
    """Whether layers run the routing predicted at the previous layer instead of the
    router's (then every predicted expert is prefetched)."""
    computes_on_host: ClassVar[bool] = False
    """Whether it computes experts on the host (each layer needs a host kernel)."""
    substitutes: ClassVar[bool] = False
    """Whether it substitutes resident experts for missing ones behind BuddyMoE's gates."""
    uses_buddy_lists: ClassVar[bool] = False
    """Whether substitutes come from co-activation buddy lists (else: any resident)."""
    waits_for_copies: ClassVar[bool] = True
    """Whether an expert still being copied counts as resident (the call waits for it).
    Policies that can compute it on the host instead treat it as missing."""

    @classmethod
    def calibration_need(cls, config: SpecExpertConfig) -> str | None:
        """Why this policy needs the calibration's routing statistics under ``config``
        (``None``: it does not)."""
        if cls.uses_buddy_lists:
            return "buddy lists come from its co-activation counts"
        if cls.substitutes and config.buddy.tau is None:
            return "the TAE gate's tau comes from its percentiles (buddy.tau_percentile)"
        return None

    def routing(
        self, topk_weights: torch.Tensor, topk_ids: torch.Tensor, prediction: Prediction | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing this policy executes, given the router's and the prediction made
        for this layer at the previous one (if any). Default: the router's."""
        return topk_weights, topk_ids

    def plan(
        self, ids: np.ndarray, resident: np.ndarray, topk_weights: torch.Tensor,
        context: MissContext,
    ) -> MissPlan | None:
        """Decide about the entries of the routing ``ids`` ([T, K]) whose expert is not
        ``resident`` ([E] mask; there is at least one). ``None``: load them (``fetch``)."""
        return None
