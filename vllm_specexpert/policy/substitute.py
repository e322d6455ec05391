"""``buddy`` and ``random``: run a resident expert in place of a missing one, behind
BuddyMoE's gates (see :mod:`vllm_specexpert.policy.buddies`); missing entries that no
substitute qualifies for are fetched. ``random`` is the paper's baseline: any resident
expert instead of a co-activated buddy, same gates."""

from __future__ import annotations

from typing import Protocol, cast

import numpy as np
import torch

from vllm_specexpert.config.modes import MISS_POLICIES
from vllm_specexpert.policy.base import MissContext, MissPlan, MissPolicy
from vllm_specexpert.policy.buddies import BuddyGates, substitute, token_activating_entropy

SUBSTITUTED = "substituted"
"""The place of substituted entries (registered by the ``substitution`` feature): they
run on the device, their substitute's id in the plan."""


class Substitutes(Protocol):
    """What substitution consults of a layer."""

    buddies: np.ndarray | None
    """``[E, K_max]`` buddy lists, best first, -1 padded (``None``: any resident)."""
    gates: BuddyGates | None
    """The gates with this layer's tau (``None`` until the calibration gives it)."""
    rng: np.random.Generator
    """Randomness of the ``random`` baseline (seeded: runs are repeatable)."""


def substitution_plan(
    ids: np.ndarray,
    resident: np.ndarray,
    topk_weights: torch.Tensor,
    context: MissContext,
    use_buddies: bool = True,
) -> MissPlan:
    """Entries substituted where the gates allow; the rest stay as routed."""
    place = cast(Substitutes, context.places[SUBSTITUTED])
    assert place.gates is not None, "a substituting policy's layer has its gates"
    tae = token_activating_entropy(topk_weights).cpu().numpy()
    new_ids, replaced = substitute(
        ids,
        resident,
        place.buddies if use_buddies else None,
        tae,
        place.gates,
        rng=None if use_buddies else place.rng,
    )
    return MissPlan(topk_ids=new_ids, places={SUBSTITUTED: replaced})


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
