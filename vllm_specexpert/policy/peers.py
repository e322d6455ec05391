"""Entries whose expert a mesh peer in rotation holds go to that peer, before any miss
policy decides: the policy it wraps sees those experts as resident and decides about the
others (``mesh``, whose feature registers the place :data:`PEER`)."""

from __future__ import annotations

from typing import Protocol, cast

import numpy as np
import torch

from vllm_specexpert.config.modes import MissPolicySpec
from vllm_specexpert.policy.base import MissPlan, MissPolicy
from vllm_specexpert.policy.context import MissContext

PEER = "peer"


class HeldByPeers(Protocol):
    def hosted(self) -> np.ndarray:
        """``[E]`` experts a peer in rotation holds."""
        ...


class PeersFirst(MissPolicy):
    """``policy`` with the entries of experts a peer holds sent to the peer."""

    def __init__(self, policy: MissPolicy) -> None:
        self.policy = policy

    # The base's traits are a ClassVar; the wrapper's are its policy's, per instance.
    @property
    def spec(self) -> MissPolicySpec:  # type: ignore[override]  # (the wrapped policy's traits)
        return self.policy.spec

    def plan(
        self,
        ids: np.ndarray,
        resident: np.ndarray,
        topk_weights: torch.Tensor,
        context: MissContext,
    ) -> MissPlan | None:
        peers = context.places.get(PEER)
        if peers is None:
            return self.policy.plan(ids, resident, topk_weights, context)
        hosted = cast(HeldByPeers, peers).hosted()
        remote = ~resident[ids] & hosted[ids]
        resident = resident | hosted
        plan = None
        if not resident[ids].all():
            plan = self.policy.plan(ids, resident, topk_weights, context)
        if not remote.any():
            return plan
        plan = plan or MissPlan(topk_ids=ids)
        plan.places[PEER] = remote
        return plan
