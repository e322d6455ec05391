"""The plugin is inert without its config key, and bad settings fail at engine start
with one clear error, in the calling process, before any engine process starts."""

import pytest

from vllm_harness import greedy, make_llm, shutdown
from vllm_specexpert import SpecExpertConfigError, SpecExpertUnsupportedError

VANILLA_CLASS = "vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts"
OFFLOADED_CLASS = "vllm_specexpert.layers.routed_experts.OffloadedRoutedExperts"


def expert_layer_classes(model):
    return sorted({
        f"{type(m).__module__}.{type(m).__qualname__}"
        for m in model.modules() if type(m).__name__.endswith("RoutedExperts")
    })


def test_without_the_key_vllm_is_untouched():
    reference_llm = make_llm("qwen3_moe", plugins=False)
    reference = greedy(reference_llm)
    shutdown(reference_llm)

    llm = make_llm("qwen3_moe", plugins=True)  # plugin loaded, no "specexpert" key
    try:
        assert llm.apply_model(expert_layer_classes) == [[VANILLA_CLASS]]
        outputs = greedy(llm)
        assert [c.token_ids for c in outputs] == [c.token_ids for c in reference]
        assert [c.logprobs for c in outputs] == [c.logprobs for c in reference]
        with pytest.raises(Exception, match="specexpert_stats"):
            llm.collective_rpc("specexpert_stats")
    finally:
        shutdown(llm)


@pytest.mark.parametrize(
    "specexpert, error, field",
    [
        ({"budget": 0.1}, SpecExpertConfigError, "budget"),  # 1 slot < top_k=4
        ({"budget": 17}, SpecExpertConfigError, "budget"),   # more than 16 experts
        ({"cache": "fifo"}, SpecExpertConfigError, "cache"),
        ({"bugdet": 0.5}, SpecExpertConfigError, "bugdet"),
        ({"link": {"bandwidth_gbps": -1}}, SpecExpertConfigError, "link.bandwidth_gbps"),
    ],
)
def test_bad_config_fails_before_the_engine_starts(specexpert, error, field):
    with pytest.raises(error) as info:
        make_llm("qwen3_moe", specexpert=specexpert)
    assert f"field '{field}'" in str(info.value) and "Fix:" in str(info.value)


def test_budget_error_gives_the_minimum():
    with pytest.raises(SpecExpertConfigError, match=r"top_k=4.*budget >= 4 or >= 0\.25"):
        make_llm("qwen3_moe", specexpert={"budget": 0.2})


def test_dense_model_is_rejected():
    with pytest.raises(SpecExpertUnsupportedError, match="Qwen3ForCausalLM"):
        make_llm("qwen3_dense", specexpert={"budget": 0.5})
