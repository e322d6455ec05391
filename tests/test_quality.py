"""The quality budget's monitor without vLLM (:mod:`vllm_specexpert.quality`): the
sampled exact result is ``fetch``'s, flips, KL and the accuracy loss are counted from
the logits, and the switch to exact and back happens on whole windows, per batch class.
The engine test with the embedded model is ``test_quality_engine.py``."""

import numpy as np
import pytest
import torch
from moe_reference import random_layer, random_routing, slot_kernel

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.config.sections import QualityConfig
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.features.quality import QualityFeature
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.quality import LogitHead, QualityMonitor, kl_divergence

NAMES = [f"model.layers.{i}.mlp.experts" for i in (1, 3)]
HIDDEN = 32


def identity_head(hidden: int = 4) -> LogitHead:
    """Logits = the RMS-normed hidden state: the top-1 token is the largest coordinate."""
    return LogitHead(
        norm_weight=torch.ones(hidden), eps=1e-6, weight=torch.eye(hidden), vocab_size=hidden
    )


@pytest.fixture
def engine_of(toy_engines):
    """This file's toy model (layers 1 and 3, top-4): ``engine_of(specexpert, head=True)``
    is an engine under ``specexpert``, with the identity logit head unless ``head`` is
    False."""

    def make(specexpert: dict, head: bool = True) -> OffloadEngine:
        layers = {
            name: random_layer(seed=seed, hidden=HIDDEN)
            for name, seed in zip(NAMES, (0, 1), strict=True)
        }
        engine = toy_engines(specexpert, layers, 4, indices=(1, 3), reports=False, start=False)
        if head:  # what wiring a model with a quality budget does
            engine.provide(logit_head=identity_head(HIDDEN))
        engine.start()
        return engine

    return make


RANDOM = {"budget": 0.25, "miss_policy": "random", "buddy": {"tau": 0.0, "beta": 1.0, "rho": 4}}


@pytest.mark.parametrize("over_budget", [False, True], ids=["approximate", "exact"])
def test_the_sampled_other_result_is_fetchs_or_the_modes(engine_of, over_budget):
    approx = engine_of({**RANDOM, "quality": {"sample": 1.0}})
    reference = engine_of({**RANDOM})  # the mode alone
    fetch = engine_of({"budget": 0.25})
    for batch in approx.feature(QualityFeature).monitor.budget.classes:
        batch.exact = over_budget
    changed = 0
    for step in range(4):
        x, w, ids = random_routing(8, 16, 4, hidden=HIDDEN, seed=step)
        for name, index in zip(NAMES, (1, 3), strict=True):
            served = approx.run_call(LayerCall(name, slot_kernel, x, w, ids))
            exact = fetch.run_call(LayerCall(name, slot_kernel, x, w, ids))
            mode = reference.run_call(LayerCall(name, slot_kernel, x, w, ids))
            delta = approx.feature(QualityFeature).monitor.deltas[index]
            # The exact calls load their missing experts into the cache: from the second
            # step on the mode finds another cache than it does without a budget.
            if over_budget:  # served exactly; the mode's result sampled beside it
                assert torch.equal(served, exact)
                assert step > 0 or torch.equal(delta, mode.float() - exact.float())
            else:
                assert step > 0 or torch.equal(served, mode)
                assert torch.equal(delta, exact.float() - served.float())
            changed += int((delta.abs().amax(-1) > 0).sum())
    assert changed > 0  # the mode substituted something: the comparisons could fail
    stats = approx.stats()
    # The shadow's loads are its own: the served decode counters are the mode's alone.
    substituted = stats["total"]["decode"]["substituted_entries"]
    assert substituted == 0 if over_budget else substituted > 0
    assert stats["quality"]["shadow_calls"] == 8


def monitor_of(window: int = 8, budget: float = 0.25, **config) -> QualityMonitor:
    """A monitor judging flips only, one batch class unless ``batch_classes`` is given,
    on the point estimate unless ``confidence`` is given (the switching's mechanics;
    the bounds: ``test_the_budget_judges_an_upper_bound_*``)."""
    config = {"max_accuracy_loss": None, "batch_classes": (), "confidence": 0.5, **config}
    return QualityMonitor(
        QualityConfig(max_top1_flip=budget, sample=1.0, window=window, **config),
        identity_head(),
        first_layer=0,
    )


def one_pass(monitor: QualityMonitor, flips: int, rows: int = 4) -> None:
    """A pass of ``rows`` sampled tokens whose top-1 is token 0; layer 0's difference
    moves ``flips`` of them to token 1, layer 2's changes none."""
    assert monitor.sampled_rows(0, rows) is not None
    assert monitor.sampled_rows(2, rows) is not None
    served = torch.zeros(rows, 4)
    served[:, 0] = 10.0
    moved = torch.zeros(rows, 4)
    moved[:flips, 1] = 20.0
    small = torch.zeros(rows, 4)
    small[:, 2] = 1.0
    monitor.deltas = {0: moved, 2: small}
    monitor.finish_pass(served)


def test_switches_on_a_whole_window_over_budget_and_back_under_it():
    monitor = monitor_of(window=8, budget=0.25)
    one_pass(monitor, flips=1)
    assert not monitor.exact_for(4)  # half a window, and it could still end under
    one_pass(monitor, flips=3)
    assert monitor.exact_for(4)  # 4 of 8 > 0.25
    assert monitor.budget.classes[0].last_window.flip_rate == 0.5
    one_pass(monitor, flips=2)
    one_pass(monitor, flips=0)
    assert monitor.exact_for(4) is False  # 2 of 8 <= 0.25
    one_pass(monitor, flips=1)
    one_pass(monitor, flips=1)
    assert not monitor.exact_for(4)
    stats = monitor.stats()
    assert (stats["switches_to_exact"], stats["switches_to_approximate"]) == (1, 1)
    assert stats["sampled_tokens"] == 24 and stats["top1_flips"] == 8
    # Per layer: layer 0 changed 8 tokens and flipped each; layer 2 changed every token
    # and flipped none.
    assert stats["layers"][0] == {**stats["layers"][0], "tokens": 8, "top1_flips": 8}
    assert stats["layers"][2] == {**stats["layers"][2], "tokens": 24, "top1_flips": 0}
    assert stats["layers"][2]["kl_sum"] > 0


def test_a_class_with_fewer_samples_than_its_window_says_it_has_not_judged():
    monitor = monitor_of(window=8, budget=0.25, batch_classes=(1,))
    assert monitor.stats()["judged"] is False  # nothing sampled: nothing judged
    one_pass(monitor, flips=0, rows=4)
    stats = monitor.stats()
    assert stats["batches"]["2+"]["judged"] is False and stats["judged"] is False
    assert stats["batches"]["2+"]["window_tokens"] == 4
    assert stats["batches"]["2+"]["last_window_flip_rate"] is None
    one_pass(monitor, flips=0, rows=4)  # the window's 8th token ends it
    stats = monitor.stats()
    assert stats["batches"]["2+"]["judged"] and stats["judged"]
    assert stats["batches"]["2+"]["window_tokens"] == 0
    # Another class sampled but not judged makes the whole budget unjudged again; a
    # class never sampled does not.
    assert stats["batches"]["1"]["judged"] is False
    one_pass(monitor, flips=0, rows=1)
    assert monitor.stats()["judged"] is False
    # Resetting the counters does not forget a judgement.
    monitor.reset_stats()
    assert monitor.stats()["batches"]["2+"]["judged"]


def test_batch_classes_are_judged_and_switched_apart():
    monitor = monitor_of(window=8, budget=0.25, batch_classes=(1, 8))
    assert [c.label for c in monitor.budget.classes] == ["1", "2-8", "9+"]
    for _ in range(8):  # one-token passes: every token flips
        one_pass(monitor, flips=1, rows=1)
        if monitor.exact_for(1):
            break
    one_pass(monitor, flips=0, rows=8)  # eight-token passes: none does
    assert monitor.exact_for(1)
    assert not monitor.exact_for(2) and not monitor.exact_for(8) and not monitor.exact_for(9)
    stats = monitor.stats()
    assert stats["batches"]["1"]["exact"] and stats["batches"]["1"]["top1_flip_rate"] == 1
    assert stats["batches"]["2-8"] == {
        **stats["batches"]["2-8"],
        "exact": False,
        "top1_flip_rate": 0.0,
        "sampled_tokens": 8,
    }
    one_pass(monitor, flips=0, rows=1)
    assert stats["batches"]["1"]["exact_passes"] == 0
    assert monitor.stats()["batches"]["1"]["exact_passes"] == 1  # counted in its class


def logits_pass(monitor: QualityMonitor, served: torch.Tensor, exact: torch.Tensor) -> None:
    """A pass whose sampled rows are served ``served`` and whose exact final hidden
    state is ``exact`` (the identity head: logits are the normed hidden states)."""
    monitor.sampled_rows(0, len(served))
    monitor.deltas = {0: exact - served}
    monitor.finish_pass(served)


def test_the_accuracy_loss_is_what_the_exact_probabilities_give_the_served_token():
    monitor = QualityMonitor(
        QualityConfig(max_accuracy_loss=0.1, sample=1.0, window=2, batch_classes=()),
        identity_head(),
        0,
    )
    # A near tie: exact prefers token 0 by a hair, the served token is 1. A flip that
    # costs almost nothing: p[0] - p[1] is tiny.
    exact = torch.tensor([[1.0, 0.99, 0.0, 0.0]] * 2)
    served = torch.tensor([[0.99, 1.0, 0.0, 0.0]] * 2)
    logits_pass(monitor, served, exact)
    stats = monitor.stats()
    assert stats["top1_flip_rate"] == 1.0
    p = torch.softmax(identity_head().logits(exact), -1)[0]
    assert stats["accuracy_loss"] == pytest.approx(float((p[0] - p[1]) / p[0]), rel=1e-4)
    assert stats["accuracy_loss"] < 0.02 and not monitor.exact_for(2)
    # A confident exact token served as another: the loss is most of p[exact top-1].
    confident = torch.tensor([[8.0, 0.0, 0.0, 0.0]] * 2)
    wrong = torch.tensor([[0.0, 8.0, 0.0, 0.0]] * 2)
    logits_pass(monitor, wrong, confident)
    window = monitor.budget.classes[0].last_window
    p = torch.softmax(identity_head().logits(confident), -1)[0]
    assert window.accuracy_loss_share == pytest.approx(float((p[0] - p[1]) / p[0]), rel=1e-4)
    assert window.accuracy_loss_share > 0.5 and monitor.exact_for(2)


def test_a_window_that_cannot_end_under_budget_is_judged_at_once():
    monitor = QualityMonitor(
        QualityConfig(sample=1.0, window=100, batch_classes=()), identity_head(), 0
    )  # max_accuracy_loss 0.02
    confident, wrong = torch.tensor([8.0, 0.0, 0.0, 0.0]), torch.tensor([0.0, 8.0, 0.0, 0.0])
    # One confident flip in 8 tokens: 11 % lost so far, but 92 tokens that lose nothing
    # would bring the window under 0.02. No decision yet.
    logits_pass(monitor, torch.stack([wrong] + [confident] * 7), torch.stack([confident] * 8))
    assert not monitor.exact_for(8)
    assert monitor.budget.classes[0].window.accuracy_loss_share > 0.1
    # Eight more: now no 84 tokens could bring it under. Exact after 16 of 100 tokens.
    logits_pass(monitor, torch.stack([wrong] * 8), torch.stack([confident] * 8))
    assert monitor.exact_for(8) and monitor.budget.classes[0].last_window.tokens == 16
    # Running exactly, the way back waits for a whole window.
    for _ in range(12):
        logits_pass(monitor, torch.stack([confident] * 8), torch.stack([confident] * 8))
    assert monitor.exact_for(8)  # 96 tokens that lose nothing
    logits_pass(monitor, torch.stack([confident] * 8), torch.stack([confident] * 8))
    assert not monitor.exact_for(8)


def test_the_budget_judges_an_upper_bound_of_the_flip_rate():
    # Issue 73 (7): 2 flips of 8 sit at a 0.25 limit; at 90 % confidence the window may
    # hide a higher rate, and it is over budget; 0 flips of 8 is not.
    point, bounded = monitor_of(budget=0.25), monitor_of(budget=0.25, confidence=0.9)
    for monitor in (point, bounded):
        one_pass(monitor, flips=2)
        one_pass(monitor, flips=0)
    assert not point.exact_for(4) and bounded.exact_for(4)
    window = bounded.budget.classes[0].last_window
    assert window.flip_rate == 0.25
    # Wilson's score bound: at z = 1.2816, n = 8, p = 0.25 (worked by hand).
    z = 1.2815516
    wilson = (0.25 + z**2 / 16 + z * (0.25 * 0.75 / 8 + z**2 / 256) ** 0.5) / (1 + z**2 / 8)
    assert window.flip_rate_bound(z) == pytest.approx(wilson) and wilson > 0.4
    batch = bounded.stats()["batches"]["1+"]
    assert batch["last_window_flip_rate_bound"] == pytest.approx(wilson, rel=1e-6)
    assert batch["last_window_flip_rate"] == 0.25
    clean = monitor_of(budget=0.25, confidence=0.9)
    for _ in range(2):
        one_pass(clean, flips=0)
    assert not clean.exact_for(4) and clean.budget.classes[0].last_window is not None


def test_the_budget_judges_an_upper_bound_of_the_accuracy_loss():
    # Issue 73 (7): the ratio estimator's bound, from the window's sums, against the
    # same bound computed from the tokens' own figures (a test's arithmetic, not the
    # code's: the variance of loss - share * confidence over the tokens).
    from vllm_specexpert.quality.budget import Judged

    losses = [0.0, 0.0, 0.3, 0.0, 0.05, 0.0, 0.0, 0.1]
    confidences = [0.9, 0.5, 0.6, 0.8, 0.4, 0.7, 0.95, 0.5]
    window = Judged()
    for loss, confidence in zip(losses, confidences, strict=True):
        window.add(
            Judged(1, int(loss > 0), loss, confidence, loss**2, confidence**2, loss * confidence)
        )
    share = sum(losses) / sum(confidences)
    residuals = [x - share * y for x, y in zip(losses, confidences, strict=True)]
    variance = sum(r * r for r in residuals) / (len(losses) - 1)
    z = 1.6448536
    expected = share + z * (len(losses) * variance) ** 0.5 / sum(confidences)
    assert window.accuracy_loss_share == pytest.approx(share)
    assert window.accuracy_loss_bound(z) == pytest.approx(expected)
    assert window.accuracy_loss_bound(0.0) == pytest.approx(share)
    # Judged by it: under a limit between the two, over at 95 %, under at 50 %.
    limit = (share + expected) / 2
    for confidence, over in ((0.95, True), (0.5, False)):
        monitor = QualityMonitor(
            QualityConfig(max_accuracy_loss=limit, confidence=confidence, window=8),
            identity_head(),
            0,
        )
        assert (monitor.budget.over_budget(window) is not None) == over, confidence


def test_kl_is_of_the_exact_distribution_against_the_approximate_one():
    monitor = monitor_of(window=100)
    one_pass(monitor, flips=3)
    served = torch.zeros(4, 4)
    served[:, 0] = 10.0
    other = served.clone()
    other[:3, 1] += 20.0
    other[:, 2] += 1.0
    head = identity_head()
    exact, approx = head.logits(other), head.logits(served)  # served approximately
    expected = torch.nn.functional.kl_div(
        approx.log_softmax(-1), exact.log_softmax(-1), log_target=True, reduction="sum"
    )
    assert monitor.stats()["kl_sum"] == pytest.approx(float(expected), rel=1e-5)
    assert float(kl_divergence(exact, approx).sum()) == pytest.approx(float(expected), rel=1e-5)
    assert float(expected) != pytest.approx(
        float(
            torch.nn.functional.kl_div(
                exact.log_softmax(-1), approx.log_softmax(-1), log_target=True, reduction="sum"
            )
        ),
        rel=1e-3,
    )  # the direction matters here: the check could fail


def test_rows_are_drawn_once_per_pass_at_the_sampled_share():
    monitor = QualityMonitor(QualityConfig(sample=0.3, seed=1), identity_head(), 5)
    rows = monitor.sampled_rows(5, 10_000)
    assert abs(len(rows) / 10_000 - 0.3) < 0.02
    assert monitor.sampled_rows(7, 10_000) is rows  # the same tokens at every layer
    assert monitor.sampled_rows(7, 9_999) is None  # not the pass they were drawn for
    again = monitor.sampled_rows(5, 10_000)
    assert not np.array_equal(again, rows)  # a new pass draws anew


@pytest.mark.parametrize("policy", ["fetch", "cpu", "auto"])
def test_quality_needs_a_mode_that_changes_the_output(policy):
    # cpu and auto are equivalent (other rounding only): not in the error's own list of
    # budgetable modes, and once accepted.
    with pytest.raises(SpecExpertConfigError) as error:
        SpecExpertConfig.from_dict({"miss_policy": policy, "quality": {"window": 50}})
    assert error.value.field_name == "quality" and policy in str(error.value)
    assert f"'{policy}'" not in error.value.fix
    # The default budget (given or not) and null are no setting here: they wait for an
    # approximate mode, or keep it unbudgeted.
    for quality in ({}, None):
        SpecExpertConfig.from_dict({"miss_policy": policy, "quality": quality})


def test_quality_refuses_bad_sections_and_a_budget_where_nothing_misses():
    with pytest.raises(SpecExpertConfigError) as error:  # 16 of 16 experts resident
        SpecExpertConfig.from_dict(
            {"budget": 1.0, "miss_policy": "drop", "quality": {"window": 50}}
        ).check_fits(16, 4)
    assert error.value.field_name == "quality"
    # The default an approximate mode starts with is never a reason to refuse a start:
    # with nothing missing its monitor finds nothing to judge.
    started = SpecExpertConfig.from_additional_config(
        {"specexpert": {"budget": 1.0, "miss_policy": "drop"}}
    )
    assert started.quality is not None and started.check_fits(16, 4) == 16
    # speculate changes the output with every expert resident: its budget is useful.
    SpecExpertConfig.from_dict(
        {"budget": 1.0, "miss_policy": "speculate", "predictor": "router", "quality": {}}
    ).check_fits(16, 4)
    with pytest.raises(SpecExpertConfigError) as error:
        SpecExpertConfig.from_dict({"miss_policy": "drop", "quality": {"window": 0}})
    assert error.value.field_name == "quality.window"
    with pytest.raises(SpecExpertConfigError) as error:
        SpecExpertConfig.from_dict({"miss_policy": "drop", "quality": {"max_accuracy_loss": None}})
    assert error.value.field_name == "quality" and "nothing to judge" in str(error.value)
    with pytest.raises(SpecExpertConfigError) as error:
        SpecExpertConfig.from_dict({"miss_policy": "drop", "quality": {"batch_classes": [8, 8]}})
    assert error.value.field_name == "quality.batch_classes"


def test_quality_cannot_be_turned_on_in_an_engine_started_without_it(engine_of):
    engine = engine_of(RANDOM, head=False)
    with pytest.raises(SpecExpertConfigError) as error:
        engine.reconfigure(engine.config.changed({"quality": {}}))
    assert error.value.field_name == "quality"
    engine.close()
    # Nor does the default budget reach an approximate mode there: the switch is refused
    # (naming quality null, which runs it unbudgeted), the engine runs on as it was.
    engine = engine_of({"budget": 0.25, "quality": {}}, head=False)
    with pytest.raises(SpecExpertConfigError) as error:
        engine.reconfigure(engine.config.changed({"miss_policy": "drop"}))
    assert error.value.field_name == "quality" and "null" in error.value.fix
    assert engine.config.miss_policy == "fetch"
    engine.reconfigure(engine.config.changed({"miss_policy": "drop", "quality": None}))
    assert engine.feature(QualityFeature) is None
    engine.close()


@pytest.mark.parametrize("start", ["fetch", "random"])
def test_an_approximate_mode_reached_from_an_exact_one_runs_under_the_budget(engine_of, start):
    """Issue 73 (1): the budget is built for every approximate mode the engine reaches,
    whichever mode it started in, and only there (an exact mode runs no monitor)."""
    approximate = {k: v for k, v in RANDOM.items() if k != "budget"}
    started = {**RANDOM, "quality": {}} if start == "random" else {"budget": 0.25, "quality": {}}
    engine = engine_of(started)
    for _ in range(2):
        for change, budgeted in (({"miss_policy": "fetch"}, False), (approximate, True)):
            engine.reconfigure(engine.config.changed(change))
            quality = engine.feature(QualityFeature)
            assert (quality is not None) == budgeted, change
            if budgeted:
                assert quality.monitor.config == QualityConfig()
                assert "quality budget" in engine.summary()
    engine.close()
