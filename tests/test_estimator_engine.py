"""``predictor: estimator`` and ``hybrid`` inside vLLM, and the ``router_free`` path, on
the trained model with its shipped calibration, estimator and analysis (one engine,
modes switched with ``reconfigure``)."""

import json

import pytest
from vllm_harness import cache_invariants, greedy, make_llm, shutdown, vanilla_reference

import vllm_specexpert
from specexpert_testbed.fixtures import TRAINED_MODEL
from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.predict.hybrid import hybrid_layers, read_analysis
from vllm_specexpert.tools.embedded_model import (
    TRAINED_ANALYSIS_DIR,
    TRAINED_CALIBRATION_DIR,
    TRAINED_ESTIMATOR_DIR,
)

SCHEDULING = {"max_num_batched_tokens": 32}
"""A 32-token step budget: prompts are prefilled in chunks beside decoding requests
(mixed passes, where the predictor's rows are fewer than the pass's)."""
ARTIFACTS = {
    "calibration": str(TRAINED_CALIBRATION_DIR),
    "estimator": str(TRAINED_ESTIMATOR_DIR),
    "analysis": str(TRAINED_ANALYSIS_DIR),
}


@pytest.fixture(scope="module")
def llm():
    llm = make_llm(
        TRAINED_MODEL, specexpert={"budget": 0.25, "predictor": "hybrid", **ARTIFACTS}, **SCHEDULING
    )
    yield llm
    shutdown(llm)


def decode_of(stats: dict) -> dict[int, dict]:
    """Decode counters by decoder-layer index."""
    return {stats["layer_index"][name]: layer["decode"] for name, layer in stats["layers"].items()}


def chosen_layers() -> list[int]:
    """The layers hybrid runs the estimator after, by the shipped analysis."""
    return hybrid_layers(read_analysis(TRAINED_ANALYSIS_DIR), None)[0]


def test_the_shipped_estimator_beats_quasi_hidden_where_it_is_weak():
    # The target, on the shipped analysis (131,072 held-out validation tokens):
    # the estimator's recall is higher wherever quasi_hidden is below its mean, and
    # hybrid takes those transitions.
    rows = json.loads((TRAINED_ANALYSIS_DIR / "analysis.json").read_text())["transitions"]
    mean = sum(r["quasi_hidden"]["recall"] for r in rows) / len(rows)
    weak = [r for r in rows if r["quasi_hidden"]["recall"] < mean]
    assert weak and [r["from_layer"] for r in weak] == chosen_layers()
    assert all(r["estimator"]["recall"] > r["quasi_hidden"]["recall"] for r in weak)
    assert all(r["hybrid"]["recall"] >= r["quasi_hidden"]["recall"] for r in rows)


@pytest.mark.parametrize("predictor", ["estimator", "hybrid"])
def test_prefetch_with_fetch_is_identical_to_vanilla(llm, predictor):
    vllm_specexpert.reconfigure(llm, predictor=predictor, miss_policy="fetch")
    outputs = greedy(llm)
    reference = vanilla_reference(TRAINED_MODEL, **SCHEDULING)
    assert [c.token_ids for c in outputs] == [c.token_ids for c in reference]
    assert [c.logprobs for c in outputs] == [c.logprobs for c in reference]
    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["output"] == "exact" and stats["predictor"] == predictor
    if predictor == "hybrid":
        assert f"estimator after MoE layers {chosen_layers()}" in stats["summary"]
    llm.apply_model(cache_invariants)


def test_the_estimator_predicts_better_than_quasi_hidden_online(llm):
    """Online recall on the decode path: if the estimator were not consulted (a
    fallback to quasi_hidden), the counts would be the same."""
    recall = {}
    for predictor in ("quasi_hidden", "estimator", "hybrid"):
        vllm_specexpert.reconfigure(llm, predictor=predictor, miss_policy="fetch")
        greedy(llm)
        layers = decode_of(vllm_specexpert.get_stats(llm)[0])
        recall[predictor] = {
            i: d["predicted_correct"] / d["predicted"] for i, d in layers.items() if d["predicted"]
        }
    # Layer l+1's prediction is counted at l+1; hybrid differs from quasi_hidden only
    # after its chosen layers.
    after = {i + 1 for i in chosen_layers()}
    assert sum(recall["estimator"].values()) > sum(recall["quasi_hidden"].values())
    for i, value in recall["hybrid"].items():
        if i in after:
            assert value == recall["estimator"][i]
        else:
            assert value == recall["quasi_hidden"][i]


@pytest.mark.parametrize("predictor", ["estimator", "hybrid"])
def test_router_free_skips_the_router_and_changes_nothing(llm, predictor):
    vllm_specexpert.reconfigure(
        llm, predictor=predictor, miss_policy="speculate", router_free=False
    )
    routed = greedy(llm)
    with_router = decode_of(vllm_specexpert.get_stats(llm)[0])
    vllm_specexpert.reconfigure(llm, router_free=True)
    free = greedy(llm)
    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["output"] == "approximate"
    # The same tokens and log-probabilities: the router's choice was not used anyway.
    assert [c.token_ids for c in free] == [c.token_ids for c in routed]
    assert [c.logprobs for c in free] == [c.logprobs for c in routed]
    after = (
        {i + 1 for i in chosen_layers()}
        if predictor == "hybrid"
        else set(list(decode_of(stats))[1:])
    )
    for i, layer in decode_of(stats).items():
        assert layer["speculated_calls"] == with_router[i]["speculated_calls"]
        assert with_router[i]["router_free_calls"] == 0
        if i in after:
            # Decode-only passes skipped the router; passes with a prompt chunk beside
            # (the gate runs on all their rows) did not, and only those were scored.
            assert 0 < layer["router_free_calls"] < layer["speculated_calls"]
            assert 0 < layer["predicted"] < with_router[i]["predicted"]
        else:
            assert layer["router_free_calls"] == 0
    llm.apply_model(cache_invariants)


def test_router_free_is_refused_where_it_would_do_nothing(llm):
    for change, field in (
        ({"predictor": "quasi_hidden", "router_free": True}, "router_free"),
        ({"predictor": "hybrid", "miss_policy": "fetch", "router_free": True}, "router_free"),
        ({"estimator": "/elsewhere"}, "estimator"),
        ({"analysis": None}, "analysis"),
    ):
        with pytest.raises(SpecExpertConfigError) as error:
            vllm_specexpert.reconfigure(llm, **change)
        assert error.value.field_name == field, change


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"predictor": "estimator", "calibration": "c"}, "estimator"),
        ({"predictor": "hybrid", "calibration": "c", "estimator": "e"}, "analysis"),
        ({"predictor": "estimator", "estimator": "e"}, "calibration"),
        ({"predictor": "quasi_hidden", "calibration": "c", "router_free": True}, "router_free"),
        (
            {"predictor": "estimator", "calibration": "c", "estimator": "e", "router_free": True},
            "router_free",
        ),  # under fetch
        (
            {
                "predictor": "hybrid",
                "calibration": "c",
                "estimator": "e",
                "analysis": "a",
                "hybrid_threshold": 1.5,
            },
            "hybrid_threshold",
        ),
    ],
)
def test_config_errors_name_the_field(raw, field):
    with pytest.raises(SpecExpertConfigError) as error:
        SpecExpertConfig.from_dict(raw)
    assert error.value.field_name == field


@pytest.mark.parametrize("bad", ["missing_estimator", "nan_estimator", "other_analysis"])
def test_a_bad_artifact_is_refused_at_engine_start(tmp_path, bad):
    import shutil

    from safetensors.torch import load_file, save_file

    artifacts = dict(ARTIFACTS)
    if bad == "missing_estimator":
        artifacts["estimator"], field = str(tmp_path / "nowhere"), "estimator"
    elif bad == "nan_estimator":
        shutil.copytree(TRAINED_ESTIMATOR_DIR, tmp_path / "e")
        state = load_file(str(tmp_path / "e" / "estimator.safetensors"))
        state["head.bias"][3] = float("nan")
        save_file(state, str(tmp_path / "e" / "estimator.safetensors"))
        artifacts["estimator"], field = str(tmp_path / "e"), "estimator"
    else:
        analysis = json.loads((TRAINED_ANALYSIS_DIR / "analysis.json").read_text())
        analysis["model_fingerprint"]["num_hidden_layers"] = 48
        (tmp_path / "analysis.json").write_text(json.dumps(analysis))
        artifacts["analysis"], field = str(tmp_path), "analysis"
    with pytest.raises(SpecExpertConfigError) as error:
        make_llm(TRAINED_MODEL, specexpert={"predictor": "hybrid", **artifacts})
    assert error.value.field_name == field


def test_an_estimator_trained_with_another_calibration_is_refused(tmp_path):
    import shutil

    from vllm_specexpert.predict.estimator_network import load_estimator

    other = tmp_path / "calibration"
    shutil.copytree(TRAINED_CALIBRATION_DIR, other)
    data = bytearray((other / "calibration.safetensors").read_bytes())
    data[-1] ^= 1  # one bit of a default vector
    (other / "calibration.safetensors").write_bytes(bytes(data))
    assert load_estimator(TRAINED_ESTIMATOR_DIR, calibration=TRAINED_CALIBRATION_DIR)
    with pytest.raises(SpecExpertConfigError) as error:
        load_estimator(TRAINED_ESTIMATOR_DIR, calibration=other)
    assert error.value.field_name == "estimator" and "another calibration" in str(error.value)


@pytest.mark.parametrize("damage", ["missing", "no_quasi_hidden", "no_fingerprint", "other_model"])
def test_a_bad_analysis_is_one_error_naming_it(tmp_path, damage):
    from vllm_specexpert.tools.embedded_model import TRAINED_MODEL_DIR

    analysis = json.loads((TRAINED_ANALYSIS_DIR / "analysis.json").read_text())
    if damage == "no_quasi_hidden":
        analysis["predictors"] = ["router"]
    elif damage == "no_fingerprint":
        del analysis["model_fingerprint"]
    elif damage == "other_model":
        analysis["model_fingerprint"]["router_sha256"] = "0" * 64
    if damage != "missing":
        (tmp_path / "analysis.json").write_text(json.dumps(analysis))
    with pytest.raises(SpecExpertConfigError) as error:
        read_analysis(tmp_path, model=str(TRAINED_MODEL_DIR))
    assert error.value.field_name == "analysis"


def test_hybrid_chooses_the_transitions_below_the_threshold():
    rows = [
        {"from_layer": i, "to_layer": i + 1, "quasi_hidden": {"recall": r}}
        for i, r in enumerate([0.9, 0.5, 0.8, 0.6])
    ]
    assert hybrid_layers({"transitions": rows}, None) == ([1, 3], pytest.approx(0.7))
    assert hybrid_layers({"transitions": rows}, 0.85)[0] == [1, 2, 3]
    assert hybrid_layers({"transitions": rows}, 0.0)[0] == []


@pytest.mark.slow
def test_compiled_mode_is_exact_under_fetch_and_refuses_router_free():
    """vLLM's default (compiled) mode traces the runner's gate and selection into the
    graph: no wrapper is installed (the graph stays vanilla's), and router_free, which
    would need one, is refused naming it."""
    compiled = make_llm(
        TRAINED_MODEL,
        eager=False,
        specexpert={"budget": 0.25, "predictor": "estimator", **ARTIFACTS},
    )
    try:
        outputs = greedy(compiled)
        reference = vanilla_reference(TRAINED_MODEL, eager=False)
        assert [c.token_ids for c in outputs] == [c.token_ids for c in reference]
        assert [c.logprobs for c in outputs] == [c.logprobs for c in reference]
        vllm_specexpert.reconfigure(compiled, miss_policy="speculate")
        with pytest.raises(SpecExpertConfigError) as error:
            vllm_specexpert.reconfigure(compiled, router_free=True)
        assert error.value.field_name == "router_free" and "enforce_eager" in str(error.value)
        assert greedy(compiled)  # still serving, still without router_free
    finally:
        shutdown(compiled)
