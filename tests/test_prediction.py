"""Next-layer prediction, prefetch, speculative execution and the miss policies inside
vLLM, on the trained model (whose router learned something). One plugin engine, started
with a calibration so that the quasi-hidden predictor and the buddy lists are available;
modes switch with ``reconfigure``."""

import json

import pytest
from vllm_harness import (
    PROMPTS,
    cache_invariants,
    fix_host_cost,
    greedy,
    make_llm,
    shutdown,
    vanilla_reference,
)

import vllm_specexpert
from specexpert_testbed.fixtures import TRAINED_MODEL, ensure_model, model_path
from vllm_specexpert import SpecExpertConfigError
from vllm_specexpert.tools.embedded_model import TRAINED_MODEL_DIR

BUDGET = 0.25  # a quarter of the experts of each layer
CONFIG = json.loads((model_path(TRAINED_MODEL) / "config.json").read_text())
TOP_K, EXPERTS = CONFIG["num_experts_per_tok"], CONFIG["num_local_experts"]
LAYERS = CONFIG["num_hidden_layers"]
ONE_TOKEN_PROMPT = [{"prompt_token_ids": [0]}]  # <|endoftext|>: a document starts


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    from vllm_specexpert.tools.calibrate import calibrate
    from vllm_specexpert.tools.trace import corpus_documents

    out = tmp_path_factory.mktemp("calibration")
    calibrate(model_path(TRAINED_MODEL), corpus_documents("train"), out, max_tokens=4096)
    return str(out)


@pytest.fixture(
    scope="module",
    params=[True, pytest.param(False, marks=pytest.mark.slow)],
    ids=["eager", "compiled"],
)
def eager(request):
    return request.param


@pytest.fixture(scope="module")
def llm(eager, calibration):
    llm = make_llm(
        TRAINED_MODEL,
        eager=eager,
        specexpert={"budget": BUDGET, "predictor": "quasi_hidden", "calibration": calibration},
    )
    yield llm
    shutdown(llm)


def moe_layers_after_the_first(stats):
    """Decode counters of every MoE layer but the first (which nothing predicts)."""
    return [layer["decode"] for layer in list(stats["layers"].values())[1:]]


@pytest.mark.parametrize("predictor", ["router", "quasi_hidden"])
def test_prefetch_with_fetch_is_identical_to_vanilla(llm, eager, predictor):
    vllm_specexpert.reconfigure(llm, predictor=predictor, miss_policy="fetch")
    outputs = greedy(llm)
    reference = vanilla_reference(TRAINED_MODEL, eager)
    assert [c.token_ids for c in outputs] == [c.token_ids for c in reference]
    assert [c.logprobs for c in outputs] == [c.logprobs for c in reference]
    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["output"] == "exact" and stats["predictor"] == predictor
    first = next(iter(stats["layers"].values()))
    assert first["decode"]["predicted"] == 0 and first["decode"]["prefetched"] == 0
    for layer in moe_layers_after_the_first(stats):
        assert layer["predicted"] > 0 and layer["prefetched"] > 0 and layer["prefetch_used"] > 0
        # Better than chance (k / E of the router's experts), and never above 1.
        assert 2 * TOP_K / EXPERTS < layer["recall"] <= 1.0
    # Prefill tokens are never predicted.
    assert all(layer["prefill"]["predicted"] == 0 for layer in stats["layers"].values())
    llm.apply_model(cache_invariants)


def test_speculate_runs_predicted_experts_without_refetching(llm):
    vllm_specexpert.reconfigure(llm, predictor="router", miss_policy="speculate")
    # A one-token prompt: every forward pass is one token, whose predicted experts
    # (top-k) always fit in the budget's slots.
    outputs = greedy(llm, prompts=ONE_TOKEN_PROMPT, max_tokens=16)
    assert len(outputs[0].token_ids) == 16
    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["output"] == "approximate" and stats["miss_policy"] == "speculate"
    for layer in moe_layers_after_the_first(stats):
        assert layer["speculated_calls"] == layer["calls"] > 0
        assert layer["misses"] == 0  # all executed experts were prefetched

    # The same run verified (fetch) has to load the mispredicted experts on demand.
    vllm_specexpert.reconfigure(llm, miss_policy="fetch")
    greedy(llm, prompts=ONE_TOKEN_PROMPT, max_tokens=16)
    verified = vllm_specexpert.get_stats(llm)[0]
    assert sum(layer["misses"] for layer in moe_layers_after_the_first(verified)) > 0


def test_speculate_with_every_layer_exact_is_vanilla(llm, eager):
    vllm_specexpert.reconfigure(
        llm, predictor="quasi_hidden", miss_policy="speculate", exact_layers=list(range(LAYERS))
    )
    outputs = greedy(llm)
    reference = vanilla_reference(TRAINED_MODEL, eager)
    assert [c.token_ids for c in outputs] == [c.token_ids for c in reference]
    assert all(
        layer["speculated_calls"] == 0
        for layer in moe_layers_after_the_first(vllm_specexpert.get_stats(llm)[0])
    )


def assert_equivalent_to_vanilla(llm, eager: bool, policy: str) -> None:
    """``llm``'s greedy outputs: vanilla's tokens, and logprobs that differ by bf16
    rounding only (the same experts summed in another order: differences that grow
    through the layers, small against the logprobs themselves); stats say equivalent."""
    outputs = greedy(llm)
    reference = vanilla_reference(TRAINED_MODEL, eager)
    assert [c.token_ids for c in outputs] == [c.token_ids for c in reference]
    diffs = [
        abs(a[top] - b[top])
        for out, ref in zip(outputs, reference, strict=True)
        for a, b in zip(out.logprobs, ref.logprobs, strict=True)
        for top in [max(b, key=b.get)]
    ]
    print(f"{policy}: |d logprob| mean {sum(diffs) / len(diffs):.4f} max {max(diffs):.4f}")
    assert max(diffs) < 0.25 and sum(diffs) / len(diffs) < 0.03
    assert vllm_specexpert.get_stats(llm)[0]["output"] == "equivalent"


SLOW_LINK = {"bandwidth_gbps": 0.02, "host_slowdown": 1.0}
"""A copy takes ~5 ms while the host computes an expert in well under that: ``auto``
should compute misses on the host."""


@pytest.mark.parametrize("policy, link", [("cpu", {}), ("auto", SLOW_LINK)])
def test_host_compute_keeps_vanilla_tokens(llm, eager, policy, link):
    # Without admission the host/device split depends on residency only, not on timing,
    # so the rounding (and the tokens) are repeatable.
    vllm_specexpert.reconfigure(
        llm, predictor="none", miss_policy=policy, link=link, admit_host_experts=False
    )
    # auto splits by the host's cost against the link's: the host's is fixed (0.1 ms per
    # expert, well under the emulated link's ~5 ms copy), not measured, so the split
    # (and every layer's host entries) does not depend on how loaded the machine is.
    fix_host_cost(llm, 1e-4)
    assert_equivalent_to_vanilla(llm, eager, policy)
    stats = vllm_specexpert.get_stats(llm)[0]
    assert not stats["exact"]
    decode, prefill = stats["total"]["decode"], stats["total"]["prefill"]
    assert prefill["loads"] > 0 and prefill["host_entries"] == 0  # prompts fetch, exactly
    if policy == "cpu":  # decode misses all go to the host: the cache never changes
        assert decode["loads"] == 0 and decode["host_entries"] == decode["missed_entries"] > 0
    for layer in stats["layers"].values():
        assert layer["decode"]["host_entries"] > 0 and layer["decode"]["host_s"] > 0
    llm.apply_model(cache_invariants)


@pytest.mark.parametrize(
    "policy, counter",
    [
        ("buddy", "substituted_entries"),
        ("random", "substituted_entries"),
        ("drop", "dropped_entries"),
    ],
)
def test_approximate_policies_change_outputs_and_say_so(llm, eager, policy, counter):
    vllm_specexpert.reconfigure(
        llm, predictor="none", miss_policy=policy, link={}, admit_host_experts=False
    )
    outputs = greedy(llm)
    reference = vanilla_reference(TRAINED_MODEL, eager)
    assert [c.logprobs for c in outputs] != [c.logprobs for c in reference]
    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["output"] == "approximate" and not stats["exact"]
    assert stats["miss_policy"] == policy
    assert stats["total"]["decode"][counter] > 0 and stats["total"]["prefill"][counter] == 0


def test_a_calibration_for_another_model_is_rejected_at_start(tmp_path):
    from vllm_specexpert.tools.calibrate import calibrate
    from vllm_specexpert.tools.trace import corpus_documents

    other = tmp_path / "other"
    calibrate(ensure_model("qwen3_moe"), corpus_documents("train"), other, max_tokens=256)
    with pytest.raises(SpecExpertConfigError, match="field 'calibration': made for another model"):
        make_llm(TRAINED_MODEL, specexpert={"predictor": "quasi_hidden", "calibration": str(other)})
    with pytest.raises(SpecExpertConfigError, match="not a calibration directory"):
        make_llm(
            TRAINED_MODEL, specexpert={"predictor": "quasi_hidden", "calibration": str(tmp_path)}
        )


def test_a_batch_of_96_decoding_sequences_uses_the_configured_policy(llm):
    """Prediction and the miss policy follow vLLM's decode tokens, whatever their
    number (they used to switch off above 64 tokens per pass)."""
    vllm_specexpert.reconfigure(
        llm, predictor="quasi_hidden", miss_policy="cpu", link={}, admit_host_experts=False
    )
    # Different text per sequence: a decode pass then needs more experts than the 16
    # slots (identical prompts decode identical tokens, which all route alike and may
    # all be prefetched in time, leaving no miss for the host to take).
    words = (TRAINED_MODEL_DIR / "heldout" / "test.txt").read_text().split()
    prompts = [" ".join(words[i * 12 : (i + 1) * 12]) for i in range(96)]
    max_tokens = 4
    outputs = greedy(llm, prompts=prompts, max_tokens=max_tokens)
    assert all(len(c.token_ids) == max_tokens for c in outputs)
    stats = vllm_specexpert.get_stats(llm)[0]
    # All 96 prompts are prefilled in one pass (vLLM's CPU default: 4096 tokens per
    # step), then every decode pass carries all 96 sequences.
    first = next(iter(stats["layers"].values()))["decode"]
    assert first["calls"] == max_tokens - 1 and first["tokens"] == 96 * (max_tokens - 1)
    for layer in moe_layers_after_the_first(stats):
        assert layer["predicted"] == 96 * (max_tokens - 1) * TOP_K
        assert layer["experts_needed"] > 3 * 16  # more distinct experts per call than slots
        assert layer["host_entries"] > 0
    total = stats["total"]
    # cpu never loads a decode miss on demand: every decode load is a prefetch.
    assert total["decode"]["loads"] == total["decode"]["prefetched"] > 0
    assert total["prefill"]["host_entries"] == 0 and total["prefill"]["loads"] > 0


def test_stream_reads_each_missing_expert_once_per_call_and_keeps_vanilla_tokens(llm, eager):
    # 96 sequences: a decode pass needs more experts than the 16 slots. fetch runs it in
    # groups of whole tokens and reads an expert again for each group that needs it;
    # stream reads each one once per call (prefill too).
    words = (TRAINED_MODEL_DIR / "heldout" / "test.txt").read_text().split()
    prompts = [" ".join(words[i * 12 : (i + 1) * 12]) for i in range(96)]
    loads = {}
    for policy in ("fetch", "stream"):
        vllm_specexpert.reconfigure(
            llm, predictor="none", miss_policy=policy, link={}, admit_host_experts=False
        )
        greedy(llm, prompts=prompts, max_tokens=4)
        stats = vllm_specexpert.get_stats(llm)[0]
        loads[policy] = {p: stats["total"][p]["loads"] for p in ("decode", "prefill")}
        if policy == "stream":
            for layer in stats["layers"].values():
                for phase in ("decode", "prefill"):
                    assert layer[phase]["loads"] <= layer[phase]["experts_needed"]
    assert loads["stream"]["decode"] < loads["fetch"]["decode"]
    assert loads["stream"]["prefill"] < loads["fetch"]["prefill"]
    assert_equivalent_to_vanilla(llm, eager, "stream")


@pytest.mark.parametrize(
    "change, field",
    [
        ({"budget": 2.5}, "budget"),  # pydantic: a fraction above 1
        ({"budget": 100}, "budget"),  # the engine: more than the layer's 64 experts
        ({"admit_host_experts": True, "miss_policy": "fetch"}, "admit_host_experts"),
    ],
)
def test_a_rejected_reconfigure_is_one_error_and_leaves_the_engine_as_it_was(llm, change, field):
    """D5: a bad ``reconfigure`` raises the config error in the caller (it used to come
    back as an RPC failure, logged with a traceback by the worker and the engine core)
    and the engine keeps its config and keeps serving."""
    before = vllm_specexpert.get_stats(llm)[0]["config"]
    with pytest.raises(vllm_specexpert.SpecExpertConfigError) as info:
        vllm_specexpert.reconfigure(llm, **change)
    assert info.value.field_name == field
    assert vllm_specexpert.get_stats(llm)[0]["config"] == before
    assert len(greedy(llm)) == len(PROMPTS)


def test_lowbit_needs_copies_made_at_load(llm):
    from vllm_specexpert.config import SpecExpertConfigError

    with pytest.raises(SpecExpertConfigError, match="made at load only when the engine starts"):
        vllm_specexpert.reconfigure(llm, miss_policy="lowbit")
