"""``lookahead`` (MoE-SpeQ): an INT4 draft drafts tokens through vLLM's speculative
decoding, its routes prefetch the target's experts, a governor picks the draft length.

Unit tests of the lookahead buffer and the governor, config errors, and one engine on
the trained model at budget 0.25 (``fetch``: exact) compared token for token with
vanilla vLLM at 1 and 32 sequences, with chunked prefill.
"""

import numpy as np
import pytest
from vllm_harness import (
    PROMPTS,
    greedy,
    greedy_in_fresh_process,
    make_llm,
    shutdown,
    vanilla_reference,
)

import vllm_specexpert
from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.planner.governor import (
    PROBE_EVERY,
    WARM_UP_SAMPLES,
    Governor,
    expected_tokens,
)
from vllm_specexpert.predict.draft import ExpertLookaheadBuffer
from vllm_specexpert.tools.fixtures import TRAINED_MODEL

BUDGET = 0.25
MANY = [f"{PROMPTS[i % len(PROMPTS)]}# {i}\n" for i in range(32)]


# ------------------------------------------------------------------ lookahead buffer


def test_buffer_keeps_the_verified_rows_of_each_pass():
    buffer = ExpertLookaheadBuffer(num_experts=8)
    buffer.begin()
    buffer.first_rows = np.array([2, 4])  # as vLLM's first pass lays them out
    ids = np.array([[0, 1], [0, 1], [2, 3], [0, 1], [4, 5]])
    weights = np.full(ids.shape, 0.5)
    first = buffer.record(0, ids, weights)  # pass 0: rows 2 and 4 only
    assert first.draft_pass == 0 and first.ids.tolist() == [[2, 3], [4, 5]]
    buffer.record(1, ids, weights)  # same pass, next layer
    second = buffer.record(0, np.array([[6, 7], [6, 1]]), np.full((2, 2), 0.5))
    assert second.draft_pass == 1 and buffer.passes == 2
    assert buffer.demand[0].tolist() == [0, 0.5, 0.5, 0.5, 0.5, 0.5, 1.0, 0.5]
    assert buffer.demand[1].tolist() == [0, 0, 0.5, 0.5, 0.5, 0.5, 0, 0]


# ----------------------------------------------------------------------- governor


def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 2) == 1.75
    assert expected_tokens(1.0, 4) == 5


def _measure(governor, requests, cycle_of_k, acceptance, steps):
    """Run ``steps`` steps whose cycle time is ``cycle_of_k(k)`` and whose requests
    accept drafted tokens with per-token probability ``acceptance`` (deterministic:
    the expected count, rounded down)."""
    chosen = []
    for _ in range(steps):
        k = governor.choose(requests)
        keep = governor.drafting(requests, k)
        governor.drafted(len(requests), k)
        accepted = {
            r: (k, int(sum(acceptance[r] ** i for i in range(1, k + 1))))
            for r in requests
            if r in keep and k
        }
        governor.verified(accepted, cycle_of_k(k))
        chosen.append(k)
    return chosen


def test_governor_measures_every_k_then_picks_the_fastest():
    governor = Governor(k_max=4)
    requests = ["a", "b"]
    # Drafting is cheap and every drafted token is accepted: k = 4 pays most.
    chosen = _measure(governor, requests, lambda k: 1.0 + 0.05 * k, {"a": 1.0, "b": 1.0}, 40)
    warm_up = 5 * WARM_UP_SAMPLES
    assert sorted(chosen[:warm_up]) == sorted([0, 1, 2, 3, 4] * WARM_UP_SAMPLES)
    later = chosen[warm_up:]
    assert later.count(4) >= len(later) - len(later) // PROBE_EVERY - 1
    assert governor.stats.to_dict()["acceptance"] == 1.0


def test_the_governor_drops_the_first_warm_up_sample():
    # The first pass after a start runs on a cold cache: its k must not look slow for good.
    governor = Governor(k_max=1)
    cold = iter([10.0] + [1.0] * 3)
    _measure(governor, ["a"], lambda k: next(cold), {"a": 1.0}, 4)
    assert governor.cycle_s(1, 1) == pytest.approx(1.0)  # not 8.2, an average with 10
    assert governor.choose(["a"]) == 1  # k = 1 yields 2 tokens per equal cycle


def test_a_noisy_cycle_is_shrunk_toward_the_other_draft_lengths():
    governor = Governor(k_max=2)
    # First samples dropped; then k = 0: 1.0, k = 2: 1.2 once each, k = 1: 1.1, 1.1 and
    # one slow outlier.
    for k, cycle in [
        (0, 5.0),
        (1, 5.0),
        (2, 5.0),
        (0, 1.0),
        (2, 1.2),
        (1, 1.1),
        (1, 9.0),
        (1, 1.1),
    ]:
        governor.drafted(1, k)
        governor.verified({}, cycle)
    assert governor.cycle_s(1, 1) == pytest.approx(1.1)  # not the mean, 3.7
    # The single samples sit on the line through the medians: the order is kept.
    assert governor.cycle_s(1, 0) < governor.cycle_s(1, 1) < governor.cycle_s(1, 2)
    governor.drafted(1, 2)
    governor.verified({}, 3.0)  # one slow k = 2 sample is pulled toward the line
    assert governor.cycle_s(1, 2) < (1.2 + 3.0) / 2


def test_governor_turns_drafting_off_when_it_does_not_pay():
    governor = Governor(k_max=4)
    # Each drafted token costs as much as a whole plain step, and half are rejected.
    chosen = _measure(governor, ["a"], lambda k: 1.0 + 1.0 * k, {"a": 0.5}, 40)
    assert chosen[5 * WARM_UP_SAMPLES :].count(0) >= 25
    assert governor.stats.steps_by_k[0] == chosen.count(0)


def test_governor_stops_a_request_whose_drafts_do_not_pay_and_probes_it():
    governor = Governor(k_max=2)
    requests = ["good", "bad"]
    steps = 6 * PROBE_EVERY
    _measure(governor, requests, lambda k: 1.0 + 0.4 * k, {"good": 1.0, "bad": 0.0}, steps)
    assert governor.acceptance["bad"] < 0.2 < 0.9 < governor.acceptance["good"]
    assert "bad" in governor.stopped and "good" not in governor.stopped
    # Stopped most of the time, drafting again on probe steps only.
    assert steps // 2 < governor.stats.stopped_request_steps < steps


def test_fixed_k_is_kept():
    governor = Governor(k_max=4, fixed_k=2)
    assert _measure(governor, ["a"], lambda k: 1.0, {"a": 0.0}, 10) == [2] * 10
    assert governor.drafting(["a"], 2) == {"a"}


# ------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"lookahead": {"k_max": 9}}, "lookahead.k_max"),
        ({"lookahead": {"k_max": 0}}, "lookahead.k_max"),
        ({"lookahead": {"k_max": 2, "k": 3}}, "lookahead.k"),
        ({"lookahead": {"draft_budget": 0}}, "lookahead.draft_budget"),
        ({"lookahead": {"depth": 2}}, "lookahead.depth"),
        ({"lookahead": {}, "token_scheduler": {}, "path_predictor": "x"}, "token_scheduler"),
    ],
)
def test_bad_lookahead_settings_name_their_field(raw, field):
    with pytest.raises(SpecExpertConfigError) as error:
        SpecExpertConfig.from_dict(raw)
    assert error.value.field_name == field


def test_plec_takes_its_demand_from_the_draft():
    config = SpecExpertConfig.from_dict({"cache": "plec", "lookahead": {}})
    assert config.lookahead.k_max == 4 and config.lookahead.k is None
    with pytest.raises(SpecExpertConfigError, match="lookahead"):
        SpecExpertConfig.from_dict({"cache": "plec"})


@pytest.mark.parametrize(
    "model, specexpert, engine, field",
    [
        (
            TRAINED_MODEL,
            {"lookahead": {}},
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
            "lookahead",
        ),
        (
            TRAINED_MODEL,
            {"lookahead": {"k_max": 2}},
            {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 3}},
            "lookahead",
        ),
        (TRAINED_MODEL, {"lookahead": {"draft_budget": 0.03}}, {}, "lookahead.draft_budget"),
    ],
)
def test_lookahead_refuses_at_start(model, specexpert, engine, field):
    from vllm import EngineArgs

    from vllm_specexpert.tools.fixtures import model_path

    args = EngineArgs(
        model=str(model_path(model)),
        max_model_len=512,
        enforce_eager=True,
        additional_config={"specexpert": specexpert},
        **engine,
    )
    with pytest.raises(SpecExpertConfigError) as error:
        args.create_engine_config()
    assert error.value.field_name == field


# ------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def llm():
    # A 128-token step budget chunks prompts; 20 KV blocks of 32 tokens (640 tokens,
    # target and draft) cannot hold 32 running requests: vLLM preempts some.
    llm = make_llm(
        TRAINED_MODEL,
        specexpert={"budget": BUDGET, "lookahead": {}},
        max_num_seqs=32,
        max_num_batched_tokens=128,
        block_size=32,
        num_gpu_blocks_override=20,
        disable_log_stats=False,
    )
    yield llm
    shutdown(llm)


def _preemptions(llm) -> int:
    return next(int(m.value) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def _tokens(completions):
    return [c.token_ids for c in completions]


def test_lookahead_under_fetch_is_exact_at_one_sequence(llm):
    reference = greedy_in_fresh_process(TRAINED_MODEL, plugins=False, prompts=PROMPTS[:1])
    vllm_specexpert.reset_stats(llm)
    assert _tokens(greedy(llm, PROMPTS[:1])) == _tokens(reference["completions"])
    stats = vllm_specexpert.get_stats(llm)[0]
    lookahead = stats["lookahead"]
    assert stats["output"] == "exact"
    assert lookahead["drafted"] > 0 and lookahead["acceptance"] > 0.5
    # Accepted drafts save target passes: plain decode takes a step per token after the
    # first (23); a draft whose tokens were never used would take as many.
    assert 0 < lookahead["steps"] < 23 - 5


def test_lookahead_under_fetch_is_exact_at_32_sequences_with_chunked_prefill_and_preemption(llm):
    # 32 prompts through a 128-token step budget: prompts are chunked, and passes mix
    # verification rows with prefill rows; the KV cache is too small for all of them.
    reference = greedy_in_fresh_process(TRAINED_MODEL, plugins=False, prompts=MANY)
    vllm_specexpert.reset_stats(llm)
    preempted = _preemptions(llm)
    outputs = greedy(llm, MANY)
    assert _preemptions(llm) > preempted
    assert _tokens(outputs) == _tokens(reference["completions"])
    assert all(len(c.token_ids) == 24 for c in outputs)  # every request finished
    stats = vllm_specexpert.get_stats(llm)[0]
    decode = stats["total"]["decode"]
    # The draft's routes were prefetched and used by the verification passes.
    assert decode["prefetched"] > 0 and decode["prefetch_used"] > 0.5 * decode["prefetched"]
    assert decode["path_covered"] > 0.5 * decode["path_needed"]


def test_the_draft_holds_int4_experts(llm):
    stats = vllm_specexpert.get_stats(llm)[0]
    draft = stats["lookahead"]["draft"]
    # INT4 with a bf16 scale and zero per group of 64: under a third of bf16's bytes.
    assert 0 < draft["int4_bytes"] < stats["store_bytes"] / 3


def test_fixed_k_by_reconfigure(llm):
    vllm_specexpert.reconfigure(llm, lookahead={"k": 1})
    greedy(llm, PROMPTS[:2], max_tokens=8)
    lookahead = vllm_specexpert.get_stats(llm)[0]["lookahead"]
    assert lookahead["fixed_k"] == 1 and set(lookahead["steps_by_k"]) == {"1"}
    vllm_specexpert.reconfigure(llm, lookahead={})
    with pytest.raises(SpecExpertConfigError, match="lookahead"):
        vllm_specexpert.reconfigure(llm, lookahead={"k_max": 2})


def test_a_small_draft_pool_decodes_its_int4_experts_on_use():
    llm = make_llm(
        TRAINED_MODEL, specexpert={"budget": BUDGET, "lookahead": {"draft_budget": 0.25}}
    )
    try:
        outputs = greedy(llm)
        assert _tokens(outputs) == _tokens(vanilla_reference(TRAINED_MODEL))
        stats = vllm_specexpert.get_stats(llm)[0]
        draft = stats["lookahead"]["draft"]
        # 16 of each layer's 64 experts held decoded, in bf16: a quarter of the store.
        assert draft["decoded_slot_bytes"] * 4 == stats["store_bytes"]
        assert draft["decodes"] > 0 and stats["lookahead"]["acceptance"] > 0.5
    finally:
        shutdown(llm)
