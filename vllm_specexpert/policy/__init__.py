"""Miss policies: what a layer does when the router picks experts that are not resident.
Policies only decide (:mod:`.base`: a :class:`MissPlan` over the layer's places); the
executor carries every decision out (:mod:`vllm_specexpert.execute`). The policies here
give entries to no feature's place; a mode with a place of its own is one module under
:mod:`vllm_specexpert.features`, and the registry of every policy is there
(:func:`vllm_specexpert.features.miss_policy_classes`)."""

from vllm_specexpert.policy.base import MissPlan, MissPolicy, PlacedPolicy
from vllm_specexpert.policy.context import MissContext
from vllm_specexpert.policy.drop import DropPolicy
from vllm_specexpert.policy.fetch import FetchPolicy
from vllm_specexpert.policy.speculate import SpeculatePolicy
from vllm_specexpert.policy.stream import StreamPolicy

SPINE_POLICIES: tuple[type[MissPolicy], ...] = (
    FetchPolicy,
    StreamPolicy,
    SpeculatePolicy,
    DropPolicy,
)
"""The policies that need no feature: the device's and the ``dropped`` place every layer
has."""


__all__ = [
    "SPINE_POLICIES",
    "FetchPolicy",
    "MissContext",
    "MissPlan",
    "MissPolicy",
    "PlacedPolicy",
    "SpeculatePolicy",
]
