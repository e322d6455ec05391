"""Mixed passes: with chunked prefill, one forward pass carries a long prompt's chunk
beside decoding requests. Its prompt tokens run exactly whatever the miss policy (here
``drop``, which changes every decode token it touches); its decode tokens go through the
policy. One plugin engine on the trained model with a 32-token step budget."""

import pytest
from vllm_harness import (
    cache_invariants,
    greedy,
    greedy_in_other_process,
    make_llm,
    shutdown,
)

import vllm_specexpert
from specexpert_testbed.fixtures import TRAINED_MODEL

ENGINE = {
    "max_num_batched_tokens": 32,
    "enable_chunked_prefill": True,
    "enable_prefix_caching": False,
}
"""32 tokens per step: the long prompt takes 4 steps, beside the short one's decodes."""
SHORT = "import os\n"
LONG = (
    "# Copyright (c) the authors. All rights reserved.\n"
    "from __future__ import annotations\n\nimport collections\nimport functools\n"
    "import itertools\n\n\ndef pairwise(iterable):\n    a, b = itertools.tee(iterable)\n"
    "    next(b, None)\n    return zip(a, b)\n\n\nclass Registry(dict):\n"
    "    def register(self, name):\n        def wrap(fn):\n            self[name] = fn\n"
    "            return fn\n        return wrap\n"
)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llm():
    llm = make_llm(TRAINED_MODEL, specexpert={"budget": 0.25}, **ENGINE)
    llm.apply_model(record_passes)
    yield llm
    shutdown(llm)


def record_passes(model):
    """Worker side: record the (decode, prefill) token counts of every pass through the
    first offloaded layer."""
    from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts

    layer = next(m for m in model.modules() if isinstance(m, OffloadedRoutedExperts))
    engine, name = layer.engine, layer.layer_name
    engine.recorded_passes = []
    run_call = engine.run_call

    def recording(request):
        phases = request.phases
        if request.layer == name and phases is not None:
            engine.recorded_passes.append((len(phases.decode), len(phases.prefill)))
        return run_call(request)

    engine.run_call = recording


def recorded_passes(model):
    from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts

    engine = next(m for m in model.modules() if isinstance(m, OffloadedRoutedExperts)).engine
    passes, engine.recorded_passes = engine.recorded_passes, []
    return passes


def run(llm, policy):
    vllm_specexpert.reconfigure(llm, miss_policy=policy)
    llm.apply_model(recorded_passes)  # forget earlier passes
    short, long = greedy(llm, prompts=[SHORT, LONG], max_tokens=MAX_TOKENS, prompt_logprobs=True)
    return short, long, llm.apply_model(recorded_passes)[0], vllm_specexpert.get_stats(llm)[0]


def test_fetch_in_mixed_passes_is_vanilla(llm):
    short, long, passes, _ = run(llm, "fetch")
    assert any(decode and prefill for decode, prefill in passes), passes  # mixed passes ran
    reference = greedy_in_other_process(
        TRAINED_MODEL,
        plugins=False,
        prompts=[SHORT, LONG],
        max_tokens=MAX_TOKENS,
        prompt_logprobs=True,
        **ENGINE,
    )
    ref_short, ref_long = reference["completions"]
    assert short.token_ids == ref_short.token_ids and short.logprobs == ref_short.logprobs
    assert long.prompt_logprobs == ref_long.prompt_logprobs
    assert long.token_ids == ref_long.token_ids and long.logprobs == ref_long.logprobs
    llm.apply_model(cache_invariants)


def test_prompt_tokens_stay_exact_beside_approximate_decode_tokens(llm):
    exact_short, exact_long, _, _ = run(llm, "fetch")
    short, long, passes, stats = run(llm, "drop")
    mixed = [p for p in passes if p[0] and p[1]]
    assert mixed, passes
    # The long prompt was computed in mixed passes, beside the short one's decode
    # tokens, which dropped experts: its prompt logprobs are still the exact ones.
    assert long.prompt_logprobs == exact_long.prompt_logprobs
    assert stats["total"]["decode"]["dropped_entries"] > 0
    assert stats["total"]["prefill"]["dropped_entries"] == 0
    assert stats["output"] == "approximate"
    # The short request's continuation was decoded under `drop`: it changed.
    assert short.logprobs != exact_short.logprobs
