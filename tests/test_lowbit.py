"""``lowbit`` (HOBBIT): missing experts run from INT4 copies made at load, moved packed
into a few of the layer's slots; approximate, and labelled so.

One engine on the trained model, started with ``lowbit`` (the copies are made at load
only then), switching policies with ``reconfigure``.
"""

import pytest
from vllm_harness import (
    PROMPTS,
    agreement,
    greedy,
    make_llm,
    shutdown,
    token_ids,
    vanilla_reference,
)

import vllm_specexpert
from specexpert_testbed.fixtures import TRAINED_MODEL
from vllm_specexpert.config import SpecExpertConfigError

BUDGET = 0.25


@pytest.fixture(scope="module")
def llm():
    llm = make_llm(TRAINED_MODEL, specexpert={"budget": BUDGET, "miss_policy": "lowbit"})
    yield llm
    shutdown(llm)


def test_fetch_on_a_lowbit_engine_is_exact(llm):
    # The INT4 copies and the low-bit slots leave the exact path untouched.
    vllm_specexpert.reconfigure(llm, miss_policy="fetch")
    outputs = greedy(llm)
    reference = vanilla_reference(TRAINED_MODEL)
    assert [c.token_ids for c in outputs] == [c.token_ids for c in reference]
    assert [c.logprobs for c in outputs] == [c.logprobs for c in reference]
    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["output"] == "exact"
    assert "low-bit slots" not in stats["summary"]  # fetch keeps every slot


def test_lowbit_runs_the_int4_copies(llm):
    reference = vanilla_reference(TRAINED_MODEL)
    vllm_specexpert.reconfigure(llm, miss_policy="drop")
    dropped = agreement(token_ids(greedy(llm)), token_ids(reference))
    vllm_specexpert.reconfigure(llm, miss_policy="lowbit")
    vllm_specexpert.reset_stats(llm)
    outputs = greedy(llm)
    low_bit = agreement(token_ids(outputs), token_ids(reference))
    print(f"agreement with vanilla: lowbit {low_bit:.3f}, drop {dropped:.3f}")
    # An INT4 copy is close to its expert: far closer to vanilla than leaving it out
    # (a copy computed wrong, or not at all, would not be).
    assert low_bit > 0.8 and low_bit > dropped + 0.2

    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["output"] == "approximate" and not stats["exact"]
    assert "int4 copies" in stats["summary"] and "4 low-bit slots" in stats["summary"]
    decode = stats["total"]["decode"]
    assert decode["low_bit_entries"] > 0 and decode["low_bit_loads"] > 0
    # The copies move packed: about a quarter of a bf16 expert.
    int4 = decode["low_bit_bytes"] / decode["low_bit_loads"]
    bf16 = next(iter(stats["expert_bytes"].values()))
    assert int4 < 0.3 * bf16
    # Their slots come out of the budget: top_k (4) of each layer's 16.
    assert set(stats["slots_per_layer"].values()) == {12}
    assert decode["missed_entries"] == (decode["low_bit_entries"] + decode["fetched_entries"])


def test_lowbit_needs_room_in_the_budget(llm):
    with pytest.raises(SpecExpertConfigError, match=r"budget.*at least 8 slots"):
        vllm_specexpert.reconfigure(llm, miss_policy="lowbit", budget=0.1)
    with pytest.raises(SpecExpertConfigError, match=r"budget.*at least 8 slots"):
        vllm_specexpert.reconfigure(llm, miss_policy="lowbit", budget=6)


def test_prefill_stays_exact_under_lowbit(llm):
    # Policies decide for decode tokens only: a long prompt's prefill loads bf16 experts.
    vllm_specexpert.reconfigure(llm, miss_policy="lowbit")
    vllm_specexpert.reset_stats(llm)
    greedy(llm, prompts=PROMPTS[-1:], max_tokens=1)
    prefill = vllm_specexpert.get_stats(llm)[0]["total"]["prefill"]
    assert prefill["loads"] > 0 and prefill["low_bit_entries"] == 0
