"""Randomized stateful test of the device cache: hypothesis interleaves layer calls
(begin_run + acquire), prefetch, begin_run alone (which cancels unneeded prefetches),
admit, evict, settle and reconfigure on a small cache over the CPU link, with and without emulated copy delays,
and checks the cache's invariants (``tests/invariants.py``) after every step.

The examples are derandomized, so CI runs the same ones every time; set
``SPECEXPERT_HYPOTHESIS=explore`` to draw new ones (with a bigger budget)."""

import os
import time

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from invariants import check_cache_invariants
from moe_reference import random_layer
import torch

from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.engine import OffloadEngine

E, K = 12, 2
NAME = "model.layers.0.mlp.experts"
TENSORS = random_layer(num_experts=E, hidden=32, inter=16, seed=5)
EXPERT_BYTES = sum(t[0].numel() * t.element_size() for t in TENSORS.values())
EMULATED = {"bandwidth_gbps": EXPERT_BYTES / 300e-6 / 1e9, "latency_us": 20.0}
"""One expert copy takes ~0.3 ms: copies are still in flight when the next steps run."""

EXPLORE = os.environ.get("SPECEXPERT_HYPOTHESIS") == "explore"

expert_sets = st.lists(st.integers(0, E - 1), min_size=1, max_size=6, unique=True)


def config(budget: int, policy: str, emulated: bool) -> SpecExpertConfig:
    return SpecExpertConfig.from_dict({"budget": budget, "cache": policy,
                                       "link": EMULATED if emulated else {}})


class CacheMachine(RuleBasedStateMachine):
    @initialize(budget=st.integers(K, 8), policy=st.sampled_from(["lru", "lfu", "static"]),
                emulated=st.booleans())
    def start(self, budget, policy, emulated):
        self.engine = OffloadEngine(config(budget, policy, emulated), torch.device("cpu"))
        self.engine.add_layer(NAME, TENSORS, top_k=K, index=0)
        self.engine.start()
        self.rng = np.random.default_rng(budget)

    @property
    def loader(self):
        return self.engine.layers[NAME].loader

    @property
    def stats(self):
        return self.engine.layers[NAME].stats.decode

    def teardown(self):
        if hasattr(self, "engine"):
            loader = self.loader
            assert check_cache_invariants(loader, settle=True) == loader.cache.num_resident()
            self.engine.close()

    @rule(experts=expert_sets, with_demand=st.booleans())
    def layer_call(self, experts, with_demand):
        """What a layer call does: release the prefetches (begin_run), then acquire."""
        ids = np.array(experts)
        cache = self.loader.cache
        if not cache.capacity_for(ids):
            return
        demand = self.rng.integers(0, 3, E) if with_demand else None
        self.loader.begin_run(ids, self.stats)
        self.loader.acquire(ids, self.stats, demand)
        # Acquired experts are resident and usable now: their slots hold their bytes.
        assert cache.resident_mask()[ids].all()
        assert not set(cache.expert_slot[ids].tolist()) & set(self.loader.in_flight)

    @rule(experts=expert_sets)
    def prefetch(self, experts):
        ids = np.array(experts)
        cache = self.loader.cache
        was_resident = cache.resident_mask()[ids]
        queued = self.loader.prefetch(ids, self.stats)
        assert queued <= np.count_nonzero(~was_resident)
        assert cache.protected[ids[~was_resident][:queued]].all()

    @rule(experts=expert_sets)
    def begin_run(self, experts):
        self.loader.begin_run(np.array(experts), self.stats)
        assert not self.loader.cache.protected.any() and not self.loader.prefetches

    @rule(expert=st.integers(0, E - 1))
    def admit(self, expert):
        self.loader.admit(expert, self.stats)

    @rule(experts=expert_sets)
    def evict(self, experts):
        cache = self.loader.cache
        pinned_or_protected = cache.policy.pinned | cache.protected
        evicted = self.loader.evict(np.array(experts), self.stats)
        assert not cache.resident_mask()[evicted].any()
        assert not pinned_or_protected[evicted].any()

    @rule()
    def settle(self):
        loader = self.loader
        assert check_cache_invariants(loader, settle=True) == loader.cache.num_resident()

    @rule()
    def let_copies_progress(self):
        time.sleep(400e-6)

    @rule(budget=st.integers(K, 8), policy=st.sampled_from(["lru", "lfu", "static"]),
          emulated=st.booleans())
    def reconfigure(self, budget, policy, emulated):
        self.engine.reconfigure(config(budget, policy, emulated))
        cache = self.loader.cache
        assert cache.num_slots == budget and cache.policy.name == policy
        assert check_cache_invariants(self.loader) == budget  # warm start: every slot full

    @invariant()
    def cache_invariants(self):
        if hasattr(self, "engine"):
            check_cache_invariants(self.loader)


CacheMachine.TestCase.settings = settings(
    max_examples=1000 if EXPLORE else 300,
    stateful_step_count=60,
    derandomize=not EXPLORE,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase
