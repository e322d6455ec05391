"""The miss-policy interface, and the one way every policy's decision is carried out.

A policy looks at one layer call's routing against the cache and returns a
:class:`MissPlan`: per (token, k) entry, run it on the device (resident, or loaded on
demand), substitute another expert for it (on the device), compute it on the host, or
drop it. :meth:`MissPolicy.run` executes any plan: the device entries through
:func:`run_on_device` with the others masked out (weight 0), the host entries through
:class:`HostExperts`, then adds the two. A policy that returns no plan runs the router's
routing on the device (``fetch``), which is the bit-exact path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_specexpert.cache import ExpertCache
from vllm_specexpert.host import HostExperts
from vllm_specexpert.policy.buddies import BuddyGates
from vllm_specexpert.policy.executor import ExpertKernel, run_on_device
from vllm_specexpert.predict import Prediction


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
    """Resolves one MoE layer's routed entries against its device cache."""

    name: str = "fetch"
    waits_for_copies: bool = True
    """Whether an expert still being copied counts as resident (the call waits for it).
    Policies that can compute it on the host instead treat it as missing."""

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

    def run(
        self,
        cache: ExpertCache,
        kernel: ExpertKernel,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        before_kernel: Callable[[], None] | None = None,
        context: MissContext | None = None,
    ) -> torch.Tensor:
        """Routed-expert output for ``x`` ([tokens, hidden]). Without ``context``
        (prefill passes) every entry runs on the device, loaded on demand.
        ``before_kernel`` is called once, when the first device launch's experts are
        resident and before it starts (the engine issues the next layer's prefetch there,
        so the copy overlaps this layer's expert compute)."""
        stats = cache.stats
        stats.calls += 1
        stats.tokens += x.shape[0]
        # On CUDA this is the host sync that on-demand loading cannot avoid: which
        # experts to copy is only known once the router has run.
        ids = topk_ids.cpu().numpy()
        if context is None or self.waits_for_copies:
            resident = cache.resident_mask()
        else:
            resident = cache.ready_mask()
        missing = ~resident[ids]
        stats.missed_entries += int(np.count_nonzero(missing))
        plan = None
        if context is not None and missing.any():
            plan = self.plan(ids, resident, topk_weights, context)
        if plan is None:
            stats.fetched_entries += int(np.count_nonzero(missing))
            return run_on_device(cache, kernel, x, topk_weights, topk_ids, ids, before_kernel)
        return self._run_plan(cache, kernel, x, topk_weights, topk_ids, ids, missing, plan,
                              before_kernel, context)

    def _run_plan(
        self,
        cache: ExpertCache,
        kernel: ExpertKernel,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        ids: np.ndarray,
        missing: np.ndarray,
        plan: MissPlan,
        before_kernel: Callable[[], None] | None,
        context: MissContext,
    ) -> torch.Tensor:
        none = np.zeros(ids.shape, dtype=bool)
        substituted = plan.substituted if plan.substituted is not None else none
        on_host = plan.on_host if plan.on_host is not None else none
        dropped = plan.dropped if plan.dropped is not None else none
        on_device = ~(on_host | dropped)
        stats = cache.stats
        stats.substituted_entries += int(np.count_nonzero(substituted))
        stats.host_entries += int(np.count_nonzero(on_host))
        stats.dropped_entries += int(np.count_nonzero(dropped))
        fetched = missing & on_device & ~substituted
        stats.fetched_entries += int(np.count_nonzero(fetched))
        # Missing experts that no device entry loads still count as requested and missed.
        unloaded = np.setdiff1d(ids[missing & ~fetched], plan.topk_ids[on_device])
        stats.requests += len(unloaded)
        stats.misses += len(unloaded)

        weights = topk_weights
        device_mask = torch.from_numpy(on_device).to(x.device)
        if plan.renormalize:
            kept = torch.where(device_mask, weights, 0.0).sum(-1, keepdim=True)
            weights = weights * (weights.sum(-1, keepdim=True) / kept.clamp_min(1e-20))
        started_at = time.perf_counter()
        host_job = context.host.stage(x, topk_weights, ids, on_host) if on_host.any() else None
        if on_device.all():
            new_ids = torch.from_numpy(plan.topk_ids).to(topk_ids.device, topk_ids.dtype)
            out = run_on_device(cache, kernel, x, weights, new_ids, plan.topk_ids, before_kernel)
        else:
            # Masked entries point at one of their token's device experts, weight 0: the
            # kernel has a fixed top-k, and adding 0 changes nothing.
            rows = np.flatnonzero(on_device.any(axis=1))
            mask = on_device[rows]
            first = plan.topk_ids[rows, mask.argmax(axis=1)]
            device_ids = np.where(mask, plan.topk_ids[rows], first[:, None])
            out = torch.zeros_like(x)
            if len(rows):
                index = torch.from_numpy(rows).to(x.device)
                out[index] = run_on_device(
                    cache, kernel, x[index],
                    torch.where(device_mask[index], weights[index], 0.0),
                    torch.from_numpy(device_ids).to(topk_ids.device, topk_ids.dtype),
                    device_ids, before_kernel,
                )
            elif before_kernel is not None:
                cache.begin_run(np.zeros(0, dtype=np.int64))
                before_kernel()
        if host_job is not None:
            charged, waited = context.host.finish(host_job, out, started_at)
            stats.host_experts += host_job.experts
            stats.host_s += charged
            stats.host_stall_s += waited
            if context.admit_host_experts:
                experts, counts = np.unique(ids[on_host], return_counts=True)
                cache.admit(int(experts[np.argmax(counts)]))
        return out
