"""Randomized stateful tests of the device cache: hypothesis interleaves layer calls
(begin_run + acquire), prefetch, begin_run alone (which cancels unneeded prefetches),
admit, evict, settle and reconfigure on a small cache over the CPU link, with and without
emulated copy delays, and checks the cache's invariants (``tests/invariants.py``) after
every step. :class:`CacheMachine` drives one layer's own pool (``lru``, ``lfu``, ``lrfu``,
``static``); :class:`SharedPoolMachine` drives three layers sharing one pool (``plec``):
decode calls through the engine with random predicted demand (the PLEC planner's
lookahead and preloads, cross-layer eviction), prefetches, evictions and reconfigures,
each output checked against the reference.

The examples are derandomized, so CI runs the same ones every time; set
``SPECEXPERT_HYPOTHESIS=explore`` to draw new ones (with a bigger budget)."""

import os

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from invariants import check_cache_invariants
from manual_clock import ManualClock
from moe_reference import random_layer, reference_moe, slot_kernel
from toy_engine import DemandSource

from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.features.step_demand import StepDemandFeature
from vllm_specexpert.handoff import StepDemand
from vllm_specexpert.layer_call import LayerCall

E, K = 12, 2
NAME = "model.layers.0.mlp.experts"
TENSORS = random_layer(num_experts=E, hidden=32, inter=16, seed=5)
EXPERT_BYTES = sum(t[0].numel() * t.element_size() for t in TENSORS.values())
EMULATED = {"bandwidth_gbps": EXPERT_BYTES / 300e-6 / 1e9, "latency_us": 20.0}
"""One expert copy takes ~0.3 ms: copies are still in flight when the next steps run."""

EXPLORE = os.environ.get("SPECEXPERT_HYPOTHESIS") == "explore"

expert_sets = st.lists(st.integers(0, E - 1), min_size=1, max_size=6, unique=True)


def config(budget: int, policy: str, emulated: bool) -> SpecExpertConfig:
    return SpecExpertConfig.from_dict(
        {"budget": budget, "cache": policy, "link": EMULATED if emulated else {}}
    )


def on_manual_clock(engine: OffloadEngine) -> None:
    """The engine's link on a clock the machine moves (``let_copies_progress``) or a
    wait does: which emulated copies have landed follows the steps, not the machine's
    load."""
    engine.link.clock = ManualClock(engine.link.clock.now())


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        budget=st.integers(K, 8),
        policy=st.sampled_from(["lru", "lfu", "lrfu", "static", "markov"]),
        emulated=st.booleans(),
    )
    def start(self, budget, policy, emulated):
        self.engine = OffloadEngine(config(budget, policy, emulated), torch.device("cpu"))
        self.engine.add_layer(NAME, TENSORS, top_k=K, index=0)
        self.engine.start()
        on_manual_clock(self.engine)
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
        rows = self.rng.permutation(E)[: K * (1 + len(ids) % 2)].reshape(-1, K)
        cache.policy.on_routes(rows)  # (markov counts them; its order then evicts by them)
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
        self.engine.link.clock.advance(400e-6)

    @rule(
        budget=st.integers(K, 8),
        policy=st.sampled_from(["lru", "lfu", "lrfu", "static", "markov"]),
        emulated=st.booleans(),
    )
    def reconfigure(self, budget, policy, emulated):
        self.engine.reconfigure(config(budget, policy, emulated))
        on_manual_clock(self.engine)
        cache = self.loader.cache
        assert cache.num_slots == budget and cache.policy.name == policy
        assert check_cache_invariants(self.loader) == budget  # warm start: every slot full

    @invariant()
    def cache_invariants(self):
        if hasattr(self, "engine"):
            check_cache_invariants(self.loader)


LAYERS = 3
NAMES = [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
LAYER_TENSORS = [
    random_layer(num_experts=E, hidden=32, inter=16, seed=10 + i) for i in range(LAYERS)
]
PRELOADS = st.sampled_from(["none", "step", "next"])


def shared_config(budget: int, preload: str, emulated: bool) -> SpecExpertConfig:
    return SpecExpertConfig.from_dict(
        {
            "budget": budget,
            "cache": "plec",
            "plec_preload": preload,
            "path_predictor": "/rpp",
            "link": EMULATED if emulated else {},
        }
    )


class SharedPoolMachine(RuleBasedStateMachine):
    @initialize(budget=st.integers(K, 6), preload=PRELOADS, emulated=st.booleans())
    def start(self, budget, preload, emulated):
        self.engine = OffloadEngine(shared_config(budget, preload, emulated), torch.device("cpu"))
        for index, name in enumerate(NAMES):
            self.engine.add_layer(
                name, {k: v.clone() for k, v in LAYER_TENSORS[index].items()}, top_k=K, index=index
            )
        self.engine.start()
        on_manual_clock(self.engine)
        self.budget = budget
        self.rng = np.random.default_rng(budget)

    def teardown(self):
        if hasattr(self, "engine"):
            self.check(settle=True)
            self.engine.close()

    def layer(self, index: int):
        return self.engine.layers[NAMES[index]]

    def check(self, settle: bool = False) -> None:
        for index in range(LAYERS):
            check_cache_invariants(self.layer(index).loader, settle=settle)
        pool = self.engine.pools.pools[0]
        assert pool.num_slots == LAYERS * self.budget
        held = sum(
            int(np.count_nonzero(self.layer(i).cache.expert_slot >= 0)) for i in range(LAYERS)
        )
        assert held <= pool.num_slots

    @rule(
        index=st.integers(0, LAYERS - 1),
        experts=st.lists(st.integers(0, E - 1), min_size=K, max_size=2 * K, unique=True),
        tokens=st.integers(1, 3),
        predicted=st.booleans(),
        grouped=st.booleans(),
    )
    def decode_call(self, index, experts, tokens, predicted, grouped):
        """A decode call of one layer through the engine, in a step whose predicted
        demand (random here: right or wrong) plans the shared pool."""
        ids = np.stack([self.rng.choice(experts, K, replace=False) for _ in range(tokens)])
        if predicted:

            def demand():
                return {i: self.rng.integers(0, 3, E) for i in range(LAYERS)}

            DemandSource.of(self.engine).demand = StepDemand(
                tokens=tokens, layers=demand(), next_layers=demand() if grouped else None
            )
        else:
            DemandSource.of(self.engine).demand = None
        g = torch.Generator().manual_seed(int(self.rng.integers(1 << 30)))
        x = torch.randn(tokens, 32, generator=g).bfloat16()
        w = torch.softmax(torch.randn(tokens, K, generator=g), -1)
        topk_ids = torch.from_numpy(ids).to(torch.int32)
        out = self.engine.run_call(LayerCall(NAMES[index], slot_kernel, x, w, topk_ids))
        tensors = LAYER_TENSORS[index]
        assert torch.equal(
            out, reference_moe(x, w, topk_ids, tensors["w13_weight"], tensors["w2_weight"])
        )

    @rule(index=st.integers(0, LAYERS - 1), experts=expert_sets)
    def prefetch(self, index, experts):
        layer = self.layer(index)
        layer.loader.prefetch(np.array(experts), layer.stats.decode)

    @rule(index=st.integers(0, LAYERS - 1), experts=expert_sets)
    def evict(self, index, experts):
        layer = self.layer(index)
        evicted = layer.loader.evict(np.array(experts), layer.stats.decode)
        assert not layer.cache.resident_mask()[evicted].any()

    @rule()
    def let_copies_progress(self):
        self.engine.link.clock.advance(400e-6)

    @rule(budget=st.integers(K, 6), preload=PRELOADS, emulated=st.booleans())
    def reconfigure(self, budget, preload, emulated):
        self.engine.reconfigure(shared_config(budget, preload, emulated))
        on_manual_clock(self.engine)
        self.budget = budget
        assert self.engine.feature(StepDemandFeature).planner.preload == preload

    @invariant()
    def cache_invariants(self):
        if hasattr(self, "engine"):
            self.check()


for machine, examples in ((CacheMachine, 80), (SharedPoolMachine, 60)):
    # (drawn for 25 s of the default run; SPECEXPERT_HYPOTHESIS=explore draws more)
    machine.TestCase.settings = settings(
        max_examples=1000 if EXPLORE else examples,
        stateful_step_count=60,
        derandomize=not EXPLORE,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
TestCacheMachine = CacheMachine.TestCase
TestSharedPoolMachine = SharedPoolMachine.TestCase
