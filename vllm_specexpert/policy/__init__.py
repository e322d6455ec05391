"""Miss policies: what a layer does when the router picks experts that are not resident.
Policies only decide (:mod:`.base`: a :class:`MissPlan` over the layer's places); the
executor carries every decision out (:mod:`vllm_specexpert.execute`)."""

from vllm_specexpert.policy.base import MissPlan, MissPolicy
from vllm_specexpert.policy.context import MissContext
from vllm_specexpert.policy.cpu import AutoBuddyPolicy, AutoPolicy, CpuPolicy
from vllm_specexpert.policy.drop import DropPolicy
from vllm_specexpert.policy.fetch import FetchPolicy
from vllm_specexpert.policy.lowbit import LowBitPolicy
from vllm_specexpert.policy.peers import PeersFirst
from vllm_specexpert.policy.speculate import SpeculatePolicy
from vllm_specexpert.policy.stream import StreamPolicy
from vllm_specexpert.policy.substitute import BuddyPolicy, RandomPolicy

MISS_POLICY_CLASSES: dict[str, type[MissPolicy]] = {
    cls.spec.name: cls
    for cls in (
        FetchPolicy,
        StreamPolicy,
        SpeculatePolicy,
        CpuPolicy,
        AutoPolicy,
        AutoBuddyPolicy,
        BuddyPolicy,
        RandomPolicy,
        DropPolicy,
        LowBitPolicy,
    )
}
"""Every miss policy by its config name (``miss_policy``)."""


__all__ = [
    "MISS_POLICY_CLASSES",
    "FetchPolicy",
    "MissContext",
    "MissPlan",
    "MissPolicy",
    "PeersFirst",
    "SpeculatePolicy",
]
