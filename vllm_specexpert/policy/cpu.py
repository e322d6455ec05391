"""``cpu``, ``auto`` and ``auto_buddy``: compute missing experts on the host.

``cpu`` computes every missing expert on the host (llama.cpp/KTransformers, made per
miss). ``auto`` splits each layer call's missing experts between the link and the host
by cost: fetches are serial on the link (``copy_seconds`` each), host computations are
serial on the host (:class:`HostCostModel`, measured), and both overlap each other and
the device's hits, so the call waits ``max(link time, host time)``. With the cheapest
host experts (fewest tokens) given to the host first, the best split is the ``j`` that
minimises ``max(sum of the j cheapest host times, (m - j) * copy_seconds)``; ties go to
fetching, which also leaves the expert resident for the next steps. ``auto_buddy``
substitutes buddies first where BuddyMoE's gates allow (output changes) and splits the
rest the same way.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_specexpert.config.modes import MISS_POLICIES
from vllm_specexpert.policy.base import MissContext, MissPlan, MissPolicy
from vllm_specexpert.policy.substitute import substitution_plan


class CpuPolicy(MissPolicy):
    spec = MISS_POLICIES["cpu"]

    def plan(
        self,
        ids: np.ndarray,
        resident: np.ndarray,
        topk_weights: torch.Tensor,
        context: MissContext,
    ) -> MissPlan:
        return MissPlan(topk_ids=ids, on_host=~resident[ids])


def host_share(ids: np.ndarray, missing: np.ndarray, context: MissContext) -> np.ndarray:
    """``[T, K]`` mask of the missing entries whose expert the host should compute (see
    module doc for the cost model)."""
    assert context.host is not None, "a host policy's context has its host experts"
    experts, rows = np.unique(ids[missing], return_counts=True)
    host_s = context.host.estimate(rows)
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
            plan.on_host = host_share(plan.topk_ids, missing, context)
        if plan.substituted is None and (plan.on_host is None or not plan.on_host.any()):
            return None  # fetch everything: the exact path
        return plan


class AutoBuddyPolicy(AutoPolicy):
    spec = MISS_POLICIES["auto_buddy"]
