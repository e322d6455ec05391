import numpy as np
import pytest
import torch

from moe_reference import make_cache, random_layer


def resident(cache):
    return set(int(e) for e in cache.slot_expert if e >= 0)


def check_slots_hold_their_experts(cache):
    for slot, expert in enumerate(cache.slot_expert):
        if expert < 0:
            continue
        for key, src in cache.experts.tensors.items():
            assert torch.equal(cache.slots[key][slot], src[expert]), (slot, expert)
        assert cache.expert_slot[expert] == slot


def test_pool_is_allocated_at_budget_and_warm():
    tensors = random_layer(num_experts=16)
    cache = make_cache(tensors, num_slots=4, top_k=2)
    for key, t in cache.slots.items():
        assert t.shape[0] == 4 and t.shape[1:] == tensors[key].shape[1:]
    assert resident(cache) == {0, 1, 2, 3}
    check_slots_hold_their_experts(cache)


def test_lru_evicts_least_recently_used():
    cache = make_cache(random_layer(), num_slots=4, top_k=2, policy="lru")
    cache.acquire(np.array([0, 1]))
    cache.acquire(np.array([2, 3]))
    cache.acquire(np.array([0, 1]))
    cache.acquire(np.array([5, 6]))  # 2 and 3 are least recent
    assert resident(cache) == {0, 1, 5, 6}
    assert cache.stats.misses == 2 and cache.stats.loads == 2 and cache.stats.evictions == 2
    check_slots_hold_their_experts(cache)


def test_lfu_evicts_least_frequently_used():
    cache = make_cache(random_layer(), num_slots=4, top_k=2, policy="lfu")
    for _ in range(3):
        cache.acquire(np.array([0, 1]))
    cache.acquire(np.array([2, 3]))
    cache.acquire(np.array([3]))
    cache.acquire(np.array([7, 8]))  # 2 (1 use) and 1 or 0 (3 uses)? -> 2 and 3 (2 uses)
    assert resident(cache) == {0, 1, 7, 8}
    cache.acquire(np.array([9]))  # 7 and 8 have one use each, 7 older
    assert resident(cache) == {0, 1, 8, 9}
    check_slots_hold_their_experts(cache)


def test_static_keeps_its_pinned_experts():
    cache = make_cache(random_layer(), num_slots=6, top_k=2, policy="static")
    assert cache.policy.pinned[:4].all() and not cache.policy.pinned[4:].any()
    for step in range(20):
        cache.acquire(np.array([8 + step % 8, 4 + step % 4]))
        assert {0, 1, 2, 3} <= resident(cache)
        assert len(resident(cache)) <= 6
    check_slots_hold_their_experts(cache)


def test_demand_overrides_policy_order():
    cache = make_cache(random_layer(), num_slots=4, top_k=2, policy="lru")
    cache.acquire(np.array([0, 1]))
    cache.acquire(np.array([2, 3]))
    demand = np.zeros(16, dtype=np.int64)
    demand[[2, 3]] = 5  # 2, 3 are needed again later in the batch: evict 0, 1
    cache.acquire(np.array([9, 10]), future_demand=demand)
    assert resident(cache) == {2, 3, 9, 10}


def test_hits_and_misses_are_counted():
    cache = make_cache(random_layer(), num_slots=4, top_k=2)
    cache.acquire(np.array([0, 1, 2]))
    cache.acquire(np.array([3, 12]))
    s = cache.stats
    assert (s.requests, s.hits, s.misses) == (5, 4, 1)
    assert s.bytes_loaded == cache.experts.expert_nbytes
    assert s.max_resident == 4


def test_capacity_accounts_for_pinned_experts():
    cache = make_cache(random_layer(), num_slots=6, top_k=2, policy="static")
    assert cache.capacity_for(np.array([0, 1, 2, 3, 10, 11]))
    assert not cache.capacity_for(np.array([0, 10, 11, 12]))


def test_invalid_slot_count():
    with pytest.raises(ValueError):
        make_cache(random_layer(num_experts=8), num_slots=1, top_k=2)
    with pytest.raises(ValueError):
        make_cache(random_layer(num_experts=8), num_slots=9, top_k=2)
