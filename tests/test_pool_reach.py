"""A slot pool vLLM's CPU kernel cannot address is refused before it is made: the kernel
computes an expert's offset in 32 bits (a pool of 110 slots of 40960-wide experts
crashed the process at slot 105, not at slot 50)."""

from types import SimpleNamespace

import pytest
import torch

from vllm_specexpert.budget_plan import SlotPlan, check_pool_reach
from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.tools.embedded_model import TRAINED_PATH_PREDICTOR_DIR as PATH_PREDICTOR

# The disk benchmark's widened Qwen3-style expert: w13 [2 x 40176, 256] is 20,570,112
# elements per slot; w2 [256, 40176] fewer.
SHAPES = {
    "w13_weight": ((2 * 40176, 256), torch.bfloat16),
    "w2_weight": ((256, 40176), torch.bfloat16),
}
REACH = 2**31 - 1  # vLLM's CPU kernel's (layers/slot_kernel.py)
LAYERS = [
    SimpleNamespace(
        experts=SimpleNamespace(num_experts=64, slot_shapes=SHAPES, in_place=False),
        top_k=4,
        pool_reach=REACH,
    )
    for _ in range(8)
]


def reach(config, layers):
    """The check with each layer's slots as ``config`` gives them."""
    check_pool_reach(SlotPlan(config.budget), layers)


def test_per_layer_pools_of_the_benchmark_fit():
    # 25 slots x 20,570,112 = 514 M elements per layer's pool < 2^31.
    reach(SpecExpertConfig.from_dict({"budget": 25}), LAYERS)


def test_a_shared_pool_is_checked_per_layer_since_it_splits_within_the_reach():
    # plec's 8 x 25 = 200 slots x 20,570,112 = 4.11 G elements would pass 2^31 - 1 in one
    # pool: it splits into runs of layers (SharedPools), so only one layer's slots must
    # fit: 104 = (2^31 - 1) // 20,570,112 do, 105 are refused, naming the budget.
    def plec(budget: int) -> SpecExpertConfig:
        return SpecExpertConfig.from_dict(
            {"budget": budget, "cache": "plec", "path_predictor": str(PATH_PREDICTOR)}
        )

    reach(plec(25), LAYERS)
    many = [
        SimpleNamespace(
            experts=SimpleNamespace(num_experts=128, slot_shapes=SHAPES, in_place=False),
            top_k=4,
            pool_reach=REACH,
        )
    ]
    reach(plec(104), many)
    with pytest.raises(SpecExpertConfigError, match=r"'budget'.*at most 104 slots per layer"):
        reach(plec(105), many)


def test_a_per_layer_pool_past_the_reach_names_the_budget():
    wide = {"w13_weight": ((2 * 14336, 4096), torch.bfloat16)}  # Mixtral's: 117 M a slot
    layers = [
        SimpleNamespace(
            experts=SimpleNamespace(num_experts=64, slot_shapes=wide, in_place=False),
            top_k=2,
            pool_reach=REACH,
        )
    ]
    with pytest.raises(SpecExpertConfigError, match=r"'budget'.*at most 18 slots per layer"):
        reach(SpecExpertConfig.from_dict({"budget": 19}), layers)
    reach(SpecExpertConfig.from_dict({"budget": 18}), layers)
