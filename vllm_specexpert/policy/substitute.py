"""``buddy`` and ``random``: run a resident expert in place of a missing one, behind
BuddyMoE's gates (see :mod:`vllm_specexpert.policy.buddies`); missing entries that no
substitute qualifies for are fetched. ``random`` is the paper's baseline: any resident
expert instead of a co-activated buddy, same gates."""

from __future__ import annotations

import numpy as np
import torch

from vllm_specexpert.config.modes import MISS_POLICIES
from vllm_specexpert.policy.base import MissContext, MissPlan, MissPolicy
from vllm_specexpert.policy.buddies import substitute, token_activating_entropy


def substitution_plan(
    ids: np.ndarray,
    resident: np.ndarray,
    topk_weights: torch.Tensor,
    context: MissContext,
    use_buddies: bool = True,
) -> MissPlan:
    """Entries substituted where the gates allow; the rest stay as routed."""
    assert context.gates is not None, "a substituting policy's context has its gates"
    tae = token_activating_entropy(topk_weights).cpu().numpy()
    new_ids, replaced = substitute(
        ids,
        resident,
        context.buddies if use_buddies else None,
        tae,
        context.gates,
        rng=None if use_buddies else context.rng,
    )
    return MissPlan(topk_ids=new_ids, substituted=replaced)


class BuddyPolicy(MissPolicy):
    spec = MISS_POLICIES["buddy"]

    def plan(
        self,
        ids: np.ndarray,
        resident: np.ndarray,
        topk_weights: torch.Tensor,
        context: MissContext,
    ) -> MissPlan:
        return substitution_plan(ids, resident, topk_weights, context)


class RandomPolicy(MissPolicy):
    spec = MISS_POLICIES["random"]

    def plan(
        self,
        ids: np.ndarray,
        resident: np.ndarray,
        topk_weights: torch.Tensor,
        context: MissContext,
    ) -> MissPlan:
        return substitution_plan(ids, resident, topk_weights, context, use_buddies=False)
