"""The device cache's claims, observed on its state and on the bytes in its slots.

Shared by the engine tests, the randomized stateful test and the vLLM tests (worker side,
through ``LLM.apply_model``)."""

import numpy as np
import torch


def check_cache_invariants(loader, settle: bool = False) -> int:
    """Assert what the cache of ``loader`` (an ``ExpertLoader``) promises; returns the
    number of slots whose bytes were compared. With ``settle``, first wait for every
    copy in flight, so that every resident slot is compared.

    * the pool holds exactly ``num_slots`` experts per tensor (the budget): the layer's
      own, or for a shared pool the sum of every layer's share, and the layers sharing
      it hold no more experts together; a layer's tensors cover the shared region's
      rows after its own, which hold no expert between calls;
    * the id -> slot map and the slot -> id map agree both ways: no expert sits in two
      slots, and no id maps to a freed slot or to a slot holding another expert;
    * distinct resident experts (ids the map sends to a slot) never exceed the budget;
    * every resident slot whose copy has landed holds the slow tier's bytes of the
      expert the map says it holds;
    * prefetch bookkeeping only points at resident experts and occupied slots.
    """
    cache = loader.cache
    if settle:
        loader.wait_all()
    budget = sum(c.num_slots for c in cache.pool.caches) if cache.pool.shared else cache.num_slots
    rows = cache.pool.region_rows
    for key, pool in cache.slots.items():
        assert pool.shape[0] == budget + rows, (key, pool.shape, budget)
    mapped = np.flatnonzero(cache.expert_slot >= 0)
    held = sum(int(np.count_nonzero(c.expert_slot >= 0)) for c in cache.pool.caches)
    assert held <= budget + rows, f"{held} experts mapped to {budget} + {rows} slots"
    if rows:  # a region's row held by this layer is its alone, and the region says so
        holder = cache.pool.rows.holder
        mine = [row for row in range(rows) if holder[row] is cache]
        assert sorted(mine) == sorted(
            (cache.expert_slot[cache.expert_slot >= budget] - budget).tolist()
        ), "region rows and the slot map disagree"
    for expert in mapped:
        slot = cache.expert_slot[expert]
        assert cache.slot_expert[slot] == expert, (
            f"expert {expert} -> slot {slot}, which holds {cache.slot_expert[slot]}"
        )
    for slot, expert in enumerate(cache.slot_expert):
        if expert >= 0:
            assert cache.expert_slot[expert] == slot, (
                f"slot {slot} holds {expert}, mapped to {cache.expert_slot[expert]}"
            )
    assert np.array_equal(
        np.flatnonzero(cache.pool.owner == cache.index), np.flatnonzero(cache.slot_expert >= 0)
    ), "pool owner != slot map"
    compared = 0
    for slot, expert in enumerate(cache.slot_expert):
        if expert < 0 or slot in loader.in_flight:
            continue
        # What the slow tier holds of it, in slot form (decoded, read from disk).
        for key, src in cache.experts.decoded(np.array([expert])).items():
            assert torch.equal(cache.slots[key][slot].cpu(), src[0]), (
                f"slot {slot} does not hold expert {expert}'s {key}"
            )
        compared += 1
    assert set(np.flatnonzero(cache.protected).tolist()) == set(loader.prefetches)
    assert all(cache.expert_slot[e] >= 0 for e in loader.prefetches)
    assert all(cache.pool.owner[s] >= 0 for s in loader.in_flight)
    return compared
