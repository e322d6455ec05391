"""``cpu``, ``auto`` and ``auto_buddy``: compute missing experts on the host.

``cpu``: every missing expert on the host. ``auto``: the link and the host work in
parallel, so a call waits ``max(link time, host time)``; the ``j`` cheapest host experts
go to the host, ``j`` minimising ``max(sum of their host times, (m - j) *
copy_seconds)``; ties go to fetching (the expert stays resident). ``auto_buddy``:
buddies first where BuddyMoE's gates allow, then the same split.
"""

from __future__ import annotations

from typing import Protocol, cast

import numpy as np
import torch

from vllm_specexpert.config.modes import MISS_POLICIES
from vllm_specexpert.policy.base import MissContext, MissPlan, MissPolicy
from vllm_specexpert.policy.substitute import SUBSTITUTED, substitution_plan

HOST = "host"
"""The place these policies give entries to (registered by the ``host_compute`` feature)."""


class HostCosts(Protocol):
    def estimate(self, rows: np.ndarray) -> np.ndarray:
        """Host seconds of each expert for ``rows`` tokens each."""
        ...


class CpuPolicy(MissPolicy):
    spec = MISS_POLICIES["cpu"]

    def plan(
        self,
        ids: np.ndarray,
        resident: np.ndarray,
        topk_weights: torch.Tensor,
        context: MissContext,
    ) -> MissPlan:
        return MissPlan(topk_ids=ids, places={HOST: ~resident[ids]})


def host_share(ids: np.ndarray, missing: np.ndarray, context: MissContext) -> np.ndarray:
    """``[T, K]`` mask of the missing entries the host should compute."""
    host = cast(HostCosts, context.places[HOST])
    experts, rows = np.unique(ids[missing], return_counts=True)
    host_s = host.estimate(rows)
    order = np.argsort(host_s, kind="stable")
    host_time = np.concatenate([[0.0], np.cumsum(host_s[order])])
    link_time = (len(experts) - np.arange(len(experts) + 1)) * context.copy_seconds
    best = int(np.argmin(np.maximum(host_time, link_time)))  # first minimum: fewest on host
    return missing & np.isin(ids, experts[order[:best]])


class AutoPolicy(MissPolicy):
    spec = MISS_POLICIES["auto"]

    def plan(
        self,
        ids: np.ndarray,
        resident: np.ndarray,
        topk_weights: torch.Tensor,
        context: MissContext,
    ) -> MissPlan | None:
        plan = MissPlan(topk_ids=ids)
        if self.spec.substitutes:
            plan = substitution_plan(ids, resident, topk_weights, context)
        missing = ~resident[plan.topk_ids]
        if missing.any():
            on_host = host_share(plan.topk_ids, missing, context)
            if on_host.any():
                plan.places[HOST] = on_host
        if SUBSTITUTED not in plan.places and HOST not in plan.places:
            return None  # fetch everything: the exact path
        return plan


class AutoBuddyPolicy(AutoPolicy):
    spec = MISS_POLICIES["auto_buddy"]
