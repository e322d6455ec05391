"""Miss policies: what a layer does when the router picks experts that are not resident.
Policies decide (:mod:`.base`), one executor carries every decision out (:mod:`.executor`)."""

from vllm_specexpert.policy.base import MissContext, MissPlan, MissPolicy
from vllm_specexpert.policy.cpu import AutoBuddyPolicy, AutoPolicy, CpuPolicy
from vllm_specexpert.policy.drop import DropPolicy
from vllm_specexpert.policy.executor import ExpertKernel, run_layer_call, run_on_device
from vllm_specexpert.policy.fetch import FetchPolicy
from vllm_specexpert.policy.speculate import SpeculatePolicy
from vllm_specexpert.policy.substitute import BuddyPolicy, RandomPolicy

MISS_POLICY_CLASSES: dict[str, type[MissPolicy]] = {
    cls.name: cls
    for cls in (FetchPolicy, SpeculatePolicy, CpuPolicy, AutoPolicy, AutoBuddyPolicy,
                BuddyPolicy, RandomPolicy, DropPolicy)
}
"""Every miss policy by its config name (``miss_policy``)."""


__all__ = [
    "MISS_POLICY_CLASSES", "ExpertKernel", "FetchPolicy", "MissContext", "MissPlan",
    "MissPolicy", "SpeculatePolicy", "run_layer_call", "run_on_device",
]
