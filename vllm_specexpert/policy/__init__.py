"""Miss policies: what a layer does when the router picks experts that are not resident."""

from vllm_specexpert.policy.base import ExpertKernel, MissPolicy
from vllm_specexpert.policy.fetch import FetchPolicy

MISS_POLICY_CLASSES: dict[str, type[MissPolicy]] = {FetchPolicy.name: FetchPolicy}


def make_miss_policy(name: str) -> MissPolicy:
    return MISS_POLICY_CLASSES[name]()


__all__ = ["ExpertKernel", "FetchPolicy", "MissPolicy", "make_miss_policy"]
