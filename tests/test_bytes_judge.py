"""The judge by bytes (:mod:`vllm_specexpert.planner.bytes_judge`): its ghosts count
loads and keep by their orders, a technique's reads ahead count as its loads, and the
judgment follows the ghosts' recent loads, per batch bucket."""

import numpy as np

from vllm_specexpert.planner.bytes_judge import BytesJudge, GhostResidency


def _mask(experts, size: int = 8) -> np.ndarray:
    mask = np.zeros(size, dtype=bool)
    mask[list(experts)] = True
    return mask


def test_a_ghost_loads_what_it_misses_and_evicts_the_lowest_kept():
    ghost = GhostResidency(8, 4)  # (the warm start: 0-3)
    keep = np.array([5.0, 1, 4, 2, 0, 0, 0, 0])
    assert ghost.serve(_mask({4, 5}), keep) == 2
    assert set(np.flatnonzero(ghost.resident)) == {0, 2, 4, 5}  # (1 and 3 kept least)
    assert ghost.serve(_mask({0, 4}), keep) == 0


def test_a_ghost_call_larger_than_its_slots_keeps_its_highest():
    ghost = GhostResidency(8, 4)
    keep = np.array([5.0, 1, 4, 2, 9, 0, 0, 0])
    assert ghost.serve(_mask(range(6)), keep) == 2  # (4 and 5, once each)
    assert set(np.flatnonzero(ghost.resident)) == {0, 2, 3, 4}


def _cycle(judge: BytesJudge, good: bool, calls: int, batch: int = 1) -> list[bool]:
    """Three pairs of experts in turn through four slots; the prediction keeps the next
    pair (``good``: one load a call) or the pair just gone (two a call), plain
    frequency by a fixed order (the higher ids). Returns each call's judgment."""
    pairs = [{0, 1}, {2, 3}, {4, 5}]
    judged = []
    for call in range(calls):
        now, after, before = pairs[call % 3], pairs[(call + 1) % 3], pairs[(call - 1) % 3]
        predicted = _mask(after if good else before).astype(float)
        plain = np.arange(8, dtype=float)
        judged.append(judge.serve(_mask(now), predicted, plain, batch).on)
    return judged


def test_a_prediction_that_loads_fewer_is_kept_and_one_that_loads_more_is_not():
    assert all(_cycle(BytesJudge(8, 4), good=True, calls=12)[6:])
    assert not any(_cycle(BytesJudge(8, 4), good=False, calls=12)[6:])


def test_the_judgment_is_per_batch_bucket():
    judge = BytesJudge(8, 4)
    assert not any(_cycle(judge, good=False, calls=12, batch=1)[6:])
    # A bucket with no calls yet starts from equal counts: the prediction keeps on
    # until its ghost has loaded more.
    assert _cycle(judge, good=False, calls=1, batch=8) == [True]


def test_a_prefetch_read_that_is_used_ties_and_one_that_is_not_loses():
    keep = np.arange(8, dtype=float)
    used, unused = BytesJudge(8, 4), BytesJudge(8, 4)
    for _ in range(3):
        used.ahead(_mask({6}), keep)  # (read ahead, then asked for: the same loads, earlier)
        judged = used.serve(_mask({6, 7}), keep, keep, 1)
    assert judged.on and judged.technique_loads == judged.plain_loads
    for step in range(3):
        unused.ahead(_mask({5 - step}), keep)  # (never asked for)
        judged = unused.serve(_mask({6, 7}), keep, keep, 1)
    assert not judged.on and judged.technique_loads > judged.plain_loads


def test_a_technique_that_ties_again_comes_back_once_its_excess_left_the_window():
    from vllm_specexpert.planner.bytes_judge import JUDGE_WINDOW

    keep = np.arange(8, dtype=float)
    judge = BytesJudge(8, 4)
    judge.ahead(_mask({5}), keep)  # (a wasted read)
    assert not judge.serve(_mask({6, 7}), keep, keep, 1).on
    verdicts = [judge.serve(_mask({6, 7}), keep, keep, 1).on for _ in range(JUDGE_WINDOW)]
    assert verdicts == [False] * (JUDGE_WINDOW - 1) + [True]
