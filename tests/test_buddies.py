"""Buddy lists (CFT α, K_max) and substitution gates (τ, β, ρ, uniqueness) on hand-built
cases whose answers are worked out in the comments."""

import numpy as np

from vllm_specexpert.policy.buddies import BuddyGates, buddy_lists, substitute

# Co-activation of 5 experts. Row 0: peers 1 (6), 2 (3), 3 (1) -> q = .6, .3, .1.
M = np.array(
    [
        [9, 6, 3, 1, 0],
        [6, 9, 0, 0, 2],
        [3, 0, 5, 0, 0],
        [1, 0, 0, 1, 0],
        [0, 2, 0, 0, 0],
    ]
)


def test_cft_takes_the_shortest_prefix_reaching_alpha():
    assert buddy_lists(M, alpha=0.5, k_max=4)[0].tolist() == [1, -1, -1, -1]  # .6 >= .5
    assert buddy_lists(M, alpha=0.8, k_max=4)[0].tolist() == [1, 2, -1, -1]  # .9 >= .8
    assert buddy_lists(M, alpha=1.0, k_max=4)[0].tolist() == [1, 2, 3, -1]  # all peers
    assert buddy_lists(M, alpha=1.0, k_max=2)[0].tolist() == [1, 2]  # K_max caps


def test_every_active_expert_gets_a_buddy_and_inactive_ones_none():
    lists = buddy_lists(M, alpha=0.01, k_max=3)
    assert lists[1].tolist() == [0, -1, -1]  # q(0|1) = 6/8
    assert lists[4].tolist() == [1, -1, -1]  # only peer
    inactive = buddy_lists(np.diag([3, 3]), alpha=0.9, k_max=2)
    assert (inactive == -1).all()


OPEN = BuddyGates(tau=-1.0, beta=1.01, rho=8)


def test_missing_expert_takes_its_first_resident_buddy():
    resident = np.array([True, False, True, True, False])
    buddies = np.array([[1, 2], [0, 2], [0, 1], [0, 1], [1, 0]])
    ids = np.array([[1, 3]])  # 1 missing; buddy 0 resident and unused
    new, replaced = substitute(ids, resident, buddies, np.ones(1), OPEN)
    assert new.tolist() == [[0, 3]] and replaced.tolist() == [[True, False]]


def test_no_duplicate_expert_per_token():
    resident = np.array([True, False, True, True, False])
    buddies = np.array([[1, 2], [0, 2], [0, 1], [0, 1], [0, 2]])
    # Token uses 0 already: 1's first buddy (0) is taken, so 2; then 4's buddies 0, 2
    # are both taken: 4 stays missing (falls back to fetch).
    new, replaced = substitute(np.array([[0, 1, 4]]), resident, buddies, np.ones(1), OPEN)
    assert new.tolist() == [[0, 2, 4]]
    assert replaced.tolist() == [[False, True, False]]


def test_rho_caps_replacements_per_token():
    resident = np.array([True, True, True, False, False])
    buddies = np.array([[1, 2], [0, 2], [0, 1], [0, 1], [1, 2]])
    ids = np.array([[3, 4]])
    one = BuddyGates(tau=-1.0, beta=1.01, rho=1)
    new, replaced = substitute(ids, resident, buddies, np.ones(1), one)
    assert new.tolist() == [[0, 4]] and replaced.sum() == 1


def test_tae_gate_protects_peaky_tokens():
    resident = np.array([True, False, True, True, False])
    buddies = np.array([[1, 2], [0, 2], [0, 1], [0, 1], [0, 2]])
    ids = np.array([[1, 3], [1, 3]])
    tae = np.array([0.2, 0.9])
    new, _ = substitute(ids, resident, buddies, tae, BuddyGates(tau=0.5, beta=1.01, rho=8))
    assert new.tolist() == [[1, 3], [0, 3]]  # the peaky first token keeps expert 1
    # per-token tau (layer-calibrated values broadcast per token) behaves the same
    new, _ = substitute(
        ids, resident, buddies, tae, BuddyGates(tau=np.array([0.1, 0.95]), beta=1.01, rho=8)
    )
    assert new.tolist() == [[0, 3], [1, 3]]


def test_beta_gate_skips_batches_with_many_missing_experts():
    resident = np.array([True, False, True, True, False])
    buddies = np.array([[1, 2], [0, 2], [0, 1], [0, 1], [0, 2]])
    ids = np.array([[1, 4], [1, 3]])  # requested {1, 3, 4}: 2 of 3 missing = .67
    new, replaced = substitute(ids, resident, buddies, np.ones(2), BuddyGates(-1.0, 0.6, 8))
    assert not replaced.any() and (new == ids).all()
    new, replaced = substitute(ids, resident, buddies, np.ones(2), BuddyGates(-1.0, 0.7, 8))
    assert replaced.any()


def test_random_baseline_picks_resident_unused_experts():
    resident = np.array([True, False, True, True, False, True])
    ids = np.array([[1, 3], [4, 0]])
    new, replaced = substitute(ids, resident, None, np.ones(2), OPEN, rng=np.random.default_rng(0))
    assert replaced.tolist() == [[True, False], [True, False]]
    assert resident[new].all()
    assert all(len(set(row)) == len(row) for row in new.tolist())


def substitute_one_token_at_a_time(ids, resident, buddies, tae, gates):
    """Algorithm 1 written entry by entry, as the paper states it (the reference for the
    vectorized :func:`substitute`)."""
    ids = ids.copy()
    replaced = np.zeros(ids.shape, dtype=bool)
    missing = ~resident[ids]
    requested = np.unique(ids)
    if not missing.any() or np.count_nonzero(~resident[requested]) / len(requested) >= gates.beta:
        return ids, replaced
    tau = np.broadcast_to(np.asarray(gates.tau, dtype=np.float64), (ids.shape[0],))
    for t in range(ids.shape[0]):
        if not missing[t].any() or tae[t] <= tau[t]:
            continue
        used, budget = set(ids[t].tolist()), gates.rho
        for k in np.flatnonzero(missing[t]):
            if budget == 0:
                break
            for b in buddies[ids[t, k]]:
                if b >= 0 and resident[b] and b not in used:
                    used.add(int(b))
                    ids[t, k], replaced[t, k] = b, True
                    budget -= 1
                    break
    return ids, replaced


def test_vectorized_substitution_matches_the_entry_by_entry_algorithm():
    rng = np.random.default_rng(0)
    for trial in range(200):
        num_experts, top_k, tokens = 16, 4, int(rng.integers(1, 40))
        counts = rng.integers(0, 10, (num_experts, num_experts))
        lists = buddy_lists(counts + counts.T, alpha=0.9, k_max=6)
        resident = rng.random(num_experts) < 0.5
        ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)])
        tae = rng.random(tokens)
        gates = BuddyGates(tau=float(rng.random() * 0.5), beta=1.01, rho=int(rng.integers(1, 4)))
        got = substitute(ids, resident, lists, tae, gates)
        want = substitute_one_token_at_a_time(ids, resident, lists, tae, gates)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), trial
