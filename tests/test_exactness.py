"""Greedy output with offloading (miss policy ``fetch``) is identical to vanilla vLLM.

Per model and compile mode: one vanilla run in a process of its own that never loads the
plugin, and one plugin engine that switches budget with ``reconfigure``. Models: the
embedded trained model and a random-weight fixture of every supported architecture.
Eager mode covers every model; vLLM's default compiled mode covers the Qwen3-MoE fixture
here and every model under ``make test-slow``.
"""

import pytest
from vllm_harness import (
    MAX_TOKENS,
    PROMPTS,
    cache_invariants,
    following_param,
    greedy,
    make_llm,
    shutdown,
    vanilla_reference,
    vanilla_reference_ahead,
)

import vllm_specexpert
from specexpert_testbed.fixtures import ARCHITECTURES, TRAINED_MODEL, num_moe_layers

MOE_ARCHS = [TRAINED_MODEL, *ARCHITECTURES]
BUDGETS = [1.0, 0.5, 0.25]

CASES = [(arch, True) for arch in MOE_ARCHS] + [
    pytest.param((arch, False), marks=[] if arch == "qwen3_moe" else pytest.mark.slow)
    for arch in MOE_ARCHS
]


@pytest.fixture(
    scope="module", params=CASES, ids=lambda c: f"{c[0]}-{'eager' if c[1] else 'compiled'}"
)
def engines(request):
    arch, eager = request.param
    # The other process runs this case's reference and the next's while this engine
    # starts.
    vanilla_reference_ahead(arch, eager)
    following = following_param(request)
    if following is not None:
        vanilla_reference_ahead(*following)
    llm = make_llm(arch, specexpert={"budget": 0.25}, eager=eager)
    yield arch, llm, vanilla_reference(arch, eager)
    shutdown(llm)


def resident_experts(model) -> list[list[int]]:
    """Worker side: the experts each offloaded layer holds."""
    from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts

    return [
        sorted(int(e) for e in module.engine.layers[module.layer_name].cache.slot_expert if e >= 0)
        for module in model.modules()
        if isinstance(module, OffloadedRoutedExperts)
    ]


def test_serving_starts_from_the_warm_start(engines):
    # Runs first, on the fresh engine: vLLM's profile and warm-up passes (on
    # uninitialized memory in compiled mode) ran through the layers before serving; the
    # caches are back to the warm start (the first experts of each layer) and the
    # counters at zero, so that what is served does not depend on what they loaded.
    arch, llm, _ = engines
    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["total"]["prefill"]["requests"] == stats["total"]["decode"]["requests"] == 0
    resident = llm.apply_model(resident_experts)[0]
    assert len(resident) == num_moe_layers(arch)
    for name, experts in zip(stats["layers"], resident, strict=True):
        assert experts == list(range(stats["slots_per_layer"][name]))


def test_reference_is_not_degenerate(engines):
    _, _, reference = engines
    # Different prompts lead to different continuations: the comparison can fail.
    assert len({tuple(c.token_ids) for c in reference}) == len(PROMPTS)


@pytest.mark.parametrize("budget", BUDGETS)
def test_fetch_is_identical_to_vanilla(engines, budget):
    arch, llm, reference = engines
    config = vllm_specexpert.reconfigure(llm, budget=budget, cache="lru")
    assert config["budget"] == budget
    outputs = greedy(llm)
    assert [c.token_ids for c in outputs] == [c.token_ids for c in reference]
    assert [c.logprobs for c in outputs] == [c.logprobs for c in reference]

    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["output"] == "exact" and stats["miss_policy"] == "fetch"
    assert len(stats["layers"]) == num_moe_layers(arch)
    # vLLM's split, observed: every request's first token comes from its prefill pass,
    # the other MAX_TOKENS - 1 from decode passes.
    assert stats["decode_tokens"] == len(PROMPTS) * (MAX_TOKENS - 1)
    tokenizer = llm.get_tokenizer()
    assert stats["prefill_tokens"] == sum(len(tokenizer.encode(p)) for p in PROMPTS)
    slots = []
    for name, layer in stats["layers"].items():
        slots.append(stats["slots_per_layer"][name])
        assert slots[-1] == int(budget * stats["experts_per_layer"][name])
        for phase in ("decode", "prefill"):
            if budget < 1.0:
                assert layer[phase]["misses"] > 0 and layer[phase]["bytes_loaded"] > 0
            else:
                assert layer[phase]["misses"] == 0 and layer[phase]["bytes_loaded"] == 0
    # Every slot holds the bytes of the expert the map says, nothing mapped twice.
    assert llm.apply_model(cache_invariants)[0] == slots


def test_auto_holds_every_expert_of_a_model_that_fits(engines):
    # Each of these models' experts take a few MB; this machine's free RAM holds them.
    _, llm, reference = engines
    config = vllm_specexpert.reconfigure(llm, budget="auto")
    assert config["budget"] == "auto"  # (as given: what it came to is the stats' budget)
    assert [c.token_ids for c in greedy(llm)] == [c.token_ids for c in reference]
    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["slots_per_layer"] == stats["experts_per_layer"]
    assert stats["total"]["decode"]["misses"] == stats["total"]["prefill"]["misses"] == 0
    fit = stats["budget"]
    assert fit["reason"].startswith("budget auto: ") and "every expert fits" in fit["reason"]
    assert fit["basis"] in stats["summary"]  # (the start line)


def routes_counted(model) -> list[float]:
    """Worker side: per offloaded layer, the routes its ``markov`` chain has counted."""
    from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts

    return [
        float(module.engine.layers[module.layer_name].cache.policy.seen.sum())
        for module in model.modules()
        if isinstance(module, OffloadedRoutedExperts)
    ]


@pytest.mark.parametrize("cache", ["lfu", "lrfu", "static", "markov"])
def test_other_cache_policies_are_identical(engines, cache):
    _, llm, reference = engines
    vllm_specexpert.reconfigure(llm, budget=0.5, cache=cache)
    assert [c.token_ids for c in greedy(llm)] == [c.token_ids for c in reference]
    assert vllm_specexpert.get_stats(llm)[0]["total"]["decode"]["misses"] > 0
    llm.apply_model(cache_invariants)
    if cache == "markov":  # (vLLM's decode calls hand the chain their routes)
        assert all(count > 0 for count in llm.apply_model(routes_counted)[0])


def offload_layout(model):
    """Worker side: how each offloaded layer holds its experts."""
    from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts

    rows = []
    for module in model.modules():
        if isinstance(module, OffloadedRoutedExperts):
            cache = module.engine.layers[module.layer_name].cache
            rows.append(
                {
                    "params_are_the_store": all(
                        getattr(module, key).data_ptr() == tensor.data_ptr()
                        for key, tensor in cache.experts.tensors.items()
                    ),
                    "pool_rows": sorted({t.shape[0] for t in cache.slots.values()}),
                    "num_slots": cache.num_slots,
                }
            )
    return rows


def test_pool_is_the_only_copy_and_sized_to_budget(engines):
    arch, llm, _ = engines
    vllm_specexpert.reconfigure(llm, budget=0.25)
    rows = llm.apply_model(offload_layout)[0]
    assert len(rows) == num_moe_layers(arch)
    for row in rows:
        assert row["params_are_the_store"]
        assert row["pool_rows"] == [row["num_slots"]]
