"""The pipeline's own rules (:mod:`vllm_specexpert.pipeline`): stages of a step run
maker before user, whatever order they are given in; a stage names only values a call
has and steps that exist; a cycle is refused when the pipeline is composed."""

import pytest

from vllm_specexpert.pipeline import Stage, ordered


def noop(call) -> None:
    pass


def stage(name: str, makes=(), uses=()) -> Stage:
    return Stage(name, "route", noop, makes=frozenset(makes), uses=frozenset(uses))


def test_makers_run_before_users_in_any_given_order():
    recall = stage("recall", makes={"prediction"})
    fire = stage("fire", makes={"run_prediction"}, uses={"prediction"})
    predict = stage("predict", makes={"upcoming"}, uses={"prediction", "run_prediction"})
    watch = stage("watch")
    for given in ([predict, fire, recall, watch], [watch, fire, predict, recall]):
        names = [s.name for s in ordered(given)]
        assert names.index("recall") < names.index("fire") < names.index("predict")
    # Stages no value orders keep the order they were given in.
    assert [s.name for s in ordered([watch, recall])] == ["watch", "recall"]
    assert [s.name for s in ordered([recall, watch])] == ["recall", "watch"]


def test_a_cycle_is_refused_naming_its_stages():
    a = stage("a", makes={"upcoming"}, uses={"prediction"})
    b = stage("b", makes={"prediction"}, uses={"upcoming"})
    with pytest.raises(ValueError, match="a, b"):
        ordered([a, b])


def test_a_stage_names_only_values_of_a_call_and_known_steps():
    with pytest.raises(ValueError, match="'predicted'"):
        stage("typo", uses={"predicted"})
    with pytest.raises(ValueError, match="'_reads'"):  # (the call's own bookkeeping)
        stage("private", makes={"_reads"})
    with pytest.raises(ValueError, match="step 'resolve'"):
        Stage("old", "resolve", noop)  # type: ignore[arg-type]
