"""Miss policies: what a layer does when the router picks experts that are not resident."""

from vllm_specexpert.policy.base import MissContext, MissPlan, MissPolicy
from vllm_specexpert.policy.cpu import AutoBuddyPolicy, AutoPolicy, CpuPolicy
from vllm_specexpert.policy.executor import ExpertKernel, run_on_device
from vllm_specexpert.policy.drop import DropPolicy
from vllm_specexpert.policy.fetch import FetchPolicy
from vllm_specexpert.policy.speculate import SpeculatePolicy
from vllm_specexpert.policy.substitute import BuddyPolicy, RandomPolicy

MISS_POLICY_CLASSES: dict[str, type[MissPolicy]] = {
    cls.name: cls
    for cls in (FetchPolicy, SpeculatePolicy, CpuPolicy, AutoPolicy, AutoBuddyPolicy,
                BuddyPolicy, RandomPolicy, DropPolicy)
}


def make_miss_policy(name: str) -> MissPolicy:
    return MISS_POLICY_CLASSES[name]()


__all__ = [
    "ExpertKernel", "FetchPolicy", "MissContext", "MissPlan", "MissPolicy", "SpeculatePolicy",
    "make_miss_policy", "run_on_device",
]
