"""Miss policies: what a layer does when the router picks experts that are not resident."""

from vllm_specexpert.policy.base import ExpertKernel, MissPolicy
from vllm_specexpert.policy.fetch import FetchPolicy
from vllm_specexpert.policy.speculate import SpeculatePolicy

MISS_POLICY_CLASSES: dict[str, type[MissPolicy]] = {
    cls.name: cls for cls in (FetchPolicy, SpeculatePolicy)
}


def make_miss_policy(name: str) -> MissPolicy:
    return MISS_POLICY_CLASSES[name]()


__all__ = ["ExpertKernel", "FetchPolicy", "MissPolicy", "SpeculatePolicy", "make_miss_policy"]
