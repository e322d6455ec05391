import numpy as np
import pytest
from invariants import check_cache_invariants
from moe_reference import make_loader, random_layer

from vllm_specexpert.stats import PhaseStats


def resident(loader):
    return {int(e) for e in loader.cache.slot_expert if e >= 0}


def test_pool_is_allocated_at_budget_and_warm():
    tensors = random_layer(num_experts=16)
    loader = make_loader(tensors, num_slots=4, top_k=2)
    for key, t in loader.cache.slots.items():
        assert t.shape[0] == 4 and t.shape[1:] == tensors[key].shape[1:]
    assert resident(loader) == {0, 1, 2, 3}
    assert check_cache_invariants(loader) == 4


def test_lru_evicts_least_recently_used():
    loader = make_loader(random_layer(), num_slots=4, top_k=2, policy="lru")
    stats = PhaseStats()
    loader.acquire(np.array([0, 1]), stats)
    loader.acquire(np.array([2, 3]), stats)
    loader.acquire(np.array([0, 1]), stats)
    loader.acquire(np.array([5, 6]), stats)  # 2 and 3 are least recent
    assert resident(loader) == {0, 1, 5, 6}
    s = stats
    assert s.misses == 2 and s.loads == 2 and s.evictions == 2
    assert check_cache_invariants(loader) == 4


def test_lfu_evicts_least_frequently_used():
    loader = make_loader(random_layer(), num_slots=4, top_k=2, policy="lfu")
    stats = PhaseStats()
    for _ in range(3):
        loader.acquire(np.array([0, 1]), stats)
    loader.acquire(np.array([2, 3]), stats)
    loader.acquire(np.array([3]), stats)
    loader.acquire(np.array([7, 8]), stats)  # 2 (1 use) and 1 or 0 (3 uses)? -> 2 and 3 (2 uses)
    assert resident(loader) == {0, 1, 7, 8}
    loader.acquire(np.array([9]), stats)  # 7 and 8 have one use each, 7 older
    assert resident(loader) == {0, 1, 8, 9}
    check_cache_invariants(loader)


def test_lrfu_keeps_the_often_used_over_the_once_used_and_lets_old_uses_fade():
    # Half-life 2 launches of one token: 0 and 1 used in 4 launches weigh more than 2
    # and 3 used once since (LRU would evict 0 and 1), and fade after enough launches
    # without them (LFU would keep them for good).
    loader = make_loader(random_layer(), num_slots=4, top_k=2, policy="lrfu")
    stats = PhaseStats()
    for _ in range(4):
        loader.acquire(np.array([0, 1]), stats)
    loader.acquire(np.array([2, 3]), stats)
    loader.acquire(np.array([5, 6]), stats)  # 2 and 3: 1 use, 0 and 1: 4 uses, older
    assert resident(loader) == {0, 1, 5, 6}
    for _ in range(3):
        loader.acquire(np.array([5, 6]), stats)
        loader.acquire(np.array([7, 8]), stats)
    assert resident(loader) == {5, 6, 7, 8}
    check_cache_invariants(loader)


def test_lrfu_remembers_longer_the_more_tokens_share_a_launch():
    # Launches of 16 tokens: 0 and 1's uses halve over 32 launches, so 6 launches of
    # other experts leave them resident (per launch, they would have faded to 0.5).
    loader = make_loader(random_layer(), num_slots=4, top_k=2, policy="lrfu")
    stats = PhaseStats()
    for _ in range(4):
        loader.acquire(np.array([0, 1]), stats, tokens=16)
    for other in range(6):
        loader.acquire(np.array([2 + 2 * other, 3 + 2 * other]), stats, tokens=16)
    assert {0, 1} <= resident(loader)
    check_cache_invariants(loader)


def _served(policy: str, calls: list[list[int]]) -> set[int]:
    """The experts resident after one sequence's decode ``calls`` (each: its routes handed
    to the policy, then its experts acquired), as the ``next_step`` stage orders them."""
    loader = make_loader(random_layer(), num_slots=4, top_k=2, policy=policy)
    stats = PhaseStats()
    for experts in calls:
        loader.cache.policy.on_routes(np.array([experts]))
        loader.acquire(np.array(experts), stats)
    check_cache_invariants(loader)
    return resident(loader)


def test_markov_keeps_what_the_routes_so_far_say_comes_next():
    # 4, 5 were always followed by 6, 7; then 8, 9 ran three times, so their decayed uses
    # outweigh 6, 7's. When 4, 5 come back, lrfu keeps 8, 9; markov keeps 6, 7, which
    # every time came next.
    calls = [[4, 5], [6, 7]] * 10 + [[8, 9]] * 3 + [[4, 5]]
    assert _served("lrfu", calls) == {4, 5, 8, 9}
    assert _served("markov", calls) == {4, 5, 6, 7}


def test_markov_without_routes_counted_keeps_lrfus_order():
    # No call followed another of the same size: nothing is counted, so the chance is
    # the same for every expert and lrfu's decayed uses decide.
    loader = make_loader(random_layer(), num_slots=4, top_k=2, policy="markov")
    stats = PhaseStats()
    for index, experts in enumerate([[0, 1]] * 4 + [[2, 3], [5, 6]]):
        rows = np.array([experts] * (1 + index % 2))  # (sizes alternate: never counted)
        loader.cache.policy.on_routes(rows)
        loader.acquire(np.array(experts), stats)
    assert loader.cache.policy.seen.sum() == 0
    assert resident(loader) == {0, 1, 5, 6}  # (lrfu's, above)


def test_static_keeps_its_pinned_experts():
    loader = make_loader(random_layer(), num_slots=6, top_k=2, policy="static")
    stats = PhaseStats()
    assert loader.cache.policy.pinned[:4].all() and not loader.cache.policy.pinned[4:].any()
    for step in range(20):
        loader.acquire(np.array([8 + step % 8, 4 + step % 4]), stats)
        assert {0, 1, 2, 3} <= resident(loader)
    check_cache_invariants(loader)


def test_demand_overrides_policy_order():
    loader = make_loader(random_layer(), num_slots=4, top_k=2, policy="lru")
    stats = PhaseStats()
    loader.acquire(np.array([0, 1]), stats)
    loader.acquire(np.array([2, 3]), stats)
    demand = np.zeros(16, dtype=np.int64)
    demand[[2, 3]] = 5  # 2, 3 are needed again later in the batch: evict 0, 1
    loader.acquire(np.array([9, 10]), stats, future_demand=demand)
    assert resident(loader) == {2, 3, 9, 10}


def test_hits_and_misses_are_counted_against_the_warm_start():
    tensors = random_layer(num_experts=16)
    loader = make_loader(tensors, num_slots=4, top_k=2)
    stats = PhaseStats()
    loader.acquire(np.array([0, 1, 2]), stats)  # warm start holds 0-3: three hits
    loader.acquire(np.array([3, 12]), stats)  # 3 hits, 12 misses
    s = stats
    assert (s.hits, s.misses, s.loads) == (4, 1, 1)
    # The one load moved one expert's bytes: all its tensors, nothing more.
    assert s.bytes_loaded == sum(t[12].numel() * t.element_size() for t in tensors.values())


def test_explicit_eviction_frees_unpinned_slots_only():
    loader = make_loader(random_layer(), num_slots=6, top_k=2, policy="static")
    stats = PhaseStats()
    assert loader.evict(np.array([0, 4, 9]), stats).tolist() == [4]  # 0 pinned, 9 not resident
    assert resident(loader) == {0, 1, 2, 3, 5}
    assert stats.evictions == 1
    loader.acquire(np.array([9, 10]), stats)  # one free slot, one eviction
    assert {9, 10} <= resident(loader)
    check_cache_invariants(loader)


def test_capacity_accounts_for_pinned_experts():
    cache = make_loader(random_layer(), num_slots=6, top_k=2, policy="static").cache
    assert cache.capacity_for(np.array([0, 1, 2, 3, 10, 11]))
    assert not cache.capacity_for(np.array([0, 10, 11, 12]))


def test_invalid_slot_count():
    with pytest.raises(ValueError):
        make_loader(random_layer(num_experts=8), num_slots=1, top_k=2)
    with pytest.raises(ValueError):
        make_loader(random_layer(num_experts=8), num_slots=9, top_k=2)


def test_invariant_check_catches_a_slot_holding_another_experts_bytes():
    loader = make_loader(random_layer(), num_slots=4, top_k=2)
    cache = loader.cache
    cache.slots["w2_weight"][1].copy_(cache.experts.tensors["w2_weight"][7])
    with pytest.raises(AssertionError, match="slot 1 does not hold expert 1"):
        check_cache_invariants(loader)


def test_invariant_check_catches_a_map_entry_on_a_freed_slot():
    loader = make_loader(random_layer(), num_slots=4, top_k=2)
    loader.cache.slot_expert[2] = -1  # slot freed, but expert 2 still maps to it
    with pytest.raises(AssertionError, match="expert 2 -> slot 2"):
        check_cache_invariants(loader)
