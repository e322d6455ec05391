"""The measured switch replayed without vLLM, on an injected clock, as the token
scheduler's governor uses it: where grouping costs more per decode token than running
every sequence it stops grouping and keeps at least 0.97 of the throughput of never
grouping; where it costs less it groups; a step's first sample after a switch, and a
step that ran a prompt, are no samples. The governor inside vLLM's scheduler:
``test_token_scheduler.py``; the prefetch's switch: ``test_prefetch_engine.py``."""

import pytest

from vllm_specexpert.planner.switch import (
    EXPLORE_AFTER_TOKENS,
    PROBE_STEPS,
    PROBE_TOKENS,
    WARM_UP_STEPS,
    MeasuredSwitch,
)

RUNNABLE, GROUP = 32, 8


class Replay:
    """Steps of ``RUNNABLE`` decode sequences, each taking ``cost(grouping, step)``
    seconds per decode token on the governor's clock."""

    def __init__(self, cost):
        self.now = 0.0
        self.cost = cost
        self.governor = MeasuredSwitch(
            "grouping", clock=lambda: self.now, explore_after_tokens=EXPLORE_AFTER_TOKENS
        )
        self.tokens = 0
        self.grouped = 0
        self.steps = 0

    def run(self, steps: int, decode_only=lambda step: True) -> None:
        for step in range(self.steps, self.steps + steps):
            self.steps += 1
            self.governor.step_started()
            grouping = self.governor.on(RUNNABLE)
            tokens = GROUP if grouping else RUNNABLE
            self.governor.scheduled(tokens, decode_only(step))
            self.now += tokens * self.cost(grouping, step)
            self.tokens += tokens
            self.grouped += grouping

    @property
    def throughput(self) -> float:
        return self.tokens / self.now


def probes(replay: Replay) -> int:
    """The most probe steps ``replay``'s tokens allow."""
    return PROBE_STEPS * (replay.tokens // PROBE_TOKENS + 1)


@pytest.mark.parametrize("ratio", [1.5, 1.05])
def test_where_grouping_costs_more_it_stops_and_keeps_097_of_never_grouping(ratio):
    # 48e's token scheduler read 1.48x fetch's bytes per token at 32 sequences.
    replay = Replay(lambda grouping, step: 0.1 * (ratio if grouping else 1.0))
    replay.run(2000)
    never_grouping = 1 / 0.1
    assert replay.throughput >= 0.97 * never_grouping, replay.throughput / never_grouping
    # Grouped steps: the warm-up and the probes only.
    assert replay.grouped <= WARM_UP_STEPS + probes(replay)
    stats = replay.governor.stats()["32"]
    assert stats["on_s_per_token"] == pytest.approx(0.1 * ratio)
    assert stats["off_s_per_token"] == pytest.approx(0.1)


def test_where_grouping_costs_less_it_groups():
    replay = Replay(lambda grouping, step: 0.07 if grouping else 0.1)
    replay.run(4000)
    assert replay.throughput >= 0.97 / 0.07
    untried = EXPLORE_AFTER_TOKENS // RUNNABLE  # (steps run as without it, first)
    assert replay.grouped >= 4000 - untried - WARM_UP_STEPS - probes(replay)


@pytest.mark.parametrize("ratio", [1.14, 0.7])
def test_a_short_run_never_pays_for_trying_it(ratio):
    # Issue 66: 6-12 decode tokens of 16 sequences ran 0.88-0.90x fetch, the grouped
    # warm-up most of them. A run shorter than the exploration threshold never groups,
    # whether grouping would pay or not.
    replay = Replay(lambda grouping, step: 0.1 * (ratio if grouping else 1.0))
    replay.run(EXPLORE_AFTER_TOKENS // RUNNABLE)
    assert replay.grouped == 0 and replay.throughput == pytest.approx(1 / 0.1)
    replay.run(WARM_UP_STEPS)  # (then it is tried)
    assert replay.grouped == WARM_UP_STEPS


def test_a_workload_that_changes_is_seen_by_the_probes():
    # Grouping pays for the first 1000 steps, then costs twice as much per token.
    replay = Replay(lambda grouping, step: (0.05 if step < 1000 else 0.2) if grouping else 0.1)
    replay.run(1000)
    assert replay.grouped >= 900
    before = replay.grouped
    replay.run(1000)
    # Each probe adds 2 samples of grouping's new cost to the 8 of its median: the
    # median turns within the third probe, 3 x 2048 tokens of 8-token steps.
    late = replay.grouped - before
    assert late <= 3 * PROBE_TOKENS // GROUP + WARM_UP_STEPS, late
    assert replay.governor.stats()["32"]["on_s_per_token"] == pytest.approx(0.2)


def test_the_first_step_after_a_switch_and_a_prompts_step_are_no_samples():
    # The first step of each choice is 100x slower (the other choice's cache), and every
    # 5th step also runs a prompt (10x slower): counted, both would make grouping look
    # dearer than it is. Grouping is cheaper per token.
    slow_first: set[int] = set()

    def cost(grouping, step):
        prompt = 10.0 if step % 5 == 4 else 1.0
        first = 100.0 if step in slow_first else 1.0
        return (0.07 if grouping else 0.1) * prompt * first

    replay = Replay(cost)
    last = None
    for step in range(600):
        governor = replay.governor
        governor.step_started()
        grouping = governor.on(RUNNABLE)
        if grouping != last:
            slow_first.add(step)
        last = grouping
        tokens = GROUP if grouping else RUNNABLE
        governor.scheduled(tokens, decode_only=step % 5 != 4)
        replay.now += tokens * cost(grouping, step)
    # No slow step among the samples (a median would hide a few: each is checked).
    costs = replay.governor.costs
    assert costs.samples[(32, True)] and costs.samples[(32, False)]
    assert all(t == pytest.approx(0.07) for t in costs.samples[(32, True)])
    assert all(t == pytest.approx(0.1) for t in costs.samples[(32, False)])
    assert len(slow_first) > 4  # probes switched back and forth
