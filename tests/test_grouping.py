"""Grouping decode sequences by predicted route (the token scheduler's objective)."""

import itertools

import numpy as np
import pytest

from vllm_specexpert.schedule.grouping import partition, union_size


def planted(clusters=4, per_cluster=8, pairs=512, active=32, noise=2, seed=0):
    """Sequences in clusters sharing most of their (layer, expert) pairs, shuffled."""
    rng = np.random.default_rng(seed)
    rows, labels = [], []
    for c in range(clusters):
        base = rng.choice(pairs, active, replace=False)
        for _ in range(per_cluster):
            row = np.zeros(pairs, dtype=bool)
            row[base] = True
            row[rng.choice(pairs, noise, replace=False)] = True
            rows.append(row)
            labels.append(c)
    order = rng.permutation(len(rows))
    return np.array(rows)[order], np.array(labels)[order]


def test_recovers_planted_clusters_and_beats_random_groups():
    routes, labels = planted()
    groups = partition(routes, group_size=8)
    assert sorted(len(g) for g in groups) == [8, 8, 8, 8]
    assert sorted(np.concatenate(groups).tolist()) == list(range(32))  # a partition
    assert all(len(set(labels[g])) == 1 for g in groups)
    rng = np.random.default_rng(1)
    random_groups = np.split(rng.permutation(32), 4)
    assert union_size(routes, groups) < 0.6 * union_size(routes, random_groups)


def test_small_cases_are_optimal():
    # Exhaustive check on 6 sequences in groups of 3: the greedy + swap result is the
    # best of all splits (10 of them).
    rng = np.random.default_rng(3)
    for trial in range(20):
        routes = rng.random((6, 24)) < 0.2
        groups = partition(routes, group_size=3, swap_passes=3)
        best = min(
            union_size(routes, [np.array(a), np.setdiff1d(np.arange(6), a)])
            for a in itertools.combinations(range(6), 3)
        )
        assert union_size(routes, groups) == best, trial


@pytest.mark.parametrize("required", [[5], [1, 4, 7], list(range(10))])
def test_required_rows_all_run_in_the_first_group(required):
    routes, _ = planted(clusters=2, per_cluster=5)
    mask = np.zeros(len(routes), dtype=bool)
    mask[required] = True
    groups = partition(routes, group_size=4, required=mask)
    assert set(required) <= set(groups[0].tolist())
    assert len(groups[0]) == max(4, len(required))
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(routes)))


def test_the_first_group_is_seeded_by_priority():
    routes, labels = planted(clusters=3, per_cluster=4)
    priority = np.zeros(len(routes))
    priority[7] = 5.0
    groups = partition(routes, group_size=4, priority=priority)
    assert 7 in groups[0] and set(labels[groups[0]]) == {labels[7]}
