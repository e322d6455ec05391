"""The predictive locality-aware cache (``cache: plec``) in the engine, without vLLM: one
slot pool shared by every layer (or by runs of layers, within the kernel's reach),
filled by the step's predicted demand (a :class:`StepDemand` as the scheduler attaches
it), with lookahead eviction."""

import numpy as np
import pytest
import torch
from invariants import check_cache_invariants
from moe_reference import random_layer, reference_moe, slot_kernel
from toy_engine import DemandSource

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.features.prediction import PredictionFeature
from vllm_specexpert.features.quality import QualityFeature
from vllm_specexpert.handoff import StepDemand
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.predict import PredictorInputs

E, K, H, LAYERS = 16, 2, 32, 3
NAMES = [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
LAYER_TENSORS = {
    name: random_layer(num_experts=E, hidden=H, seed=i) for i, name in enumerate(NAMES)
}


def layers() -> dict[str, dict[str, torch.Tensor]]:
    """A copy of this file's toy layers for one engine."""
    return {name: {k: v.clone() for k, v in LAYER_TENSORS[name].items()} for name in NAMES}


@pytest.fixture
def make_engine(toy_engines):
    """This file's toy model: ``make_engine(cache="plec", budget=0.25,
    plec_preload="next", start=True, **config)`` is an engine under ``cache``;
    ``plec_preload`` is given with plec only, and not at all when ``None`` (its default)."""

    def make(cache="plec", budget=0.25, plec_preload="next", start=True, **config) -> OffloadEngine:
        preload = {"plec_preload": plec_preload} if cache == "plec" and plec_preload else {}
        return toy_engines(
            {"budget": budget, "cache": cache, **preload, "path_predictor": "/rpp", **config},
            layers(),
            K,
            start=start,
        )

    return make


def demand_of(routes: dict[int, np.ndarray], tokens: int, next_routes=None) -> StepDemand:
    """Per layer index the ``[tokens, K]`` ids -> tokens per expert."""

    def counts(r):
        return {i: np.bincount(ids.ravel(), minlength=E) for i, ids in r.items()}

    return StepDemand(
        tokens=tokens,
        layers=counts(routes),
        next_layers=counts(next_routes) if next_routes else None,
    )


def run_step(engine, routes: dict[int, np.ndarray], demand: StepDemand | None, seed=0):
    """Every layer once on ``routes`` (layer index -> ``[T, K]`` ids); checks each
    output against the reference on the full expert weights."""
    DemandSource.of(engine).demand = demand
    for index, name in enumerate(NAMES):
        ids = torch.from_numpy(routes[index]).to(torch.int32)
        g = torch.Generator().manual_seed(seed * 100 + index)
        x = torch.randn(ids.shape[0], H, generator=g).bfloat16()
        w = torch.softmax(torch.randn(ids.shape, generator=g), -1)
        out = engine.run_call(LayerCall(name, slot_kernel, x, w, ids))
        t = LAYER_TENSORS[name]
        assert torch.equal(out, reference_moe(x, w, ids, t["w13_weight"], t["w2_weight"]))


def resident(engine, index) -> set[int]:
    cache = engine.layers[NAMES[index]].cache
    return set(np.flatnonzero(cache.expert_slot >= 0).tolist())


def distinct(rng, tokens) -> np.ndarray:
    return np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)])


def test_plec_needs_a_path_predictor_and_a_known_preload():
    with pytest.raises(SpecExpertConfigError, match=r"'cache'.*path_predictor"):
        SpecExpertConfig.from_dict({"cache": "plec"})
    with pytest.raises(SpecExpertConfigError, match="'plec_preload'"):
        SpecExpertConfig.from_dict(
            {"cache": "plec", "path_predictor": "/rpp", "plec_preload": "all"}
        )


def test_one_pool_at_the_total_budget_shared_by_every_layer(make_engine):
    engine = make_engine()
    caches = [engine.layers[n].cache for n in NAMES]
    assert len(engine.pools.pools) == 1
    assert all(c.pool is engine.pools.pools[0] for c in caches)
    assert engine.pools.pools[0].num_slots == LAYERS * 4  # 0.25 x 16 experts, per layer, summed
    for t in caches[0].slots.values():
        assert t.shape[0] == LAYERS * 4
    assert [len(resident(engine, i)) for i in range(LAYERS)] == [4, 4, 4]
    for c in caches:
        assert check_cache_invariants(engine.layers[NAMES[c.index]].loader) == 4


def test_slots_follow_the_predicted_demand_across_layers(make_engine):
    """Layer 1 is predicted to need 8 experts, layers 0 and 2 two each: when the step
    starts (at layer 0, whose router has chosen), layer 1's are loaded into eight slots
    (a fixed per-layer pool holds 4), and the step runs with no miss because the
    prediction was right."""
    routes = {
        0: np.array([[0, 1]] * 4),
        1: np.arange(8).reshape(4, 2) + 4,
        2: np.array([[2, 3]] * 4),
    }
    engine = make_engine()
    run_step(engine, routes, demand_of(routes, 4))
    assert resident(engine, 1) >= set(range(4, 12))
    total = engine.stats()["total"]["decode"]
    assert total["misses"] == 0 and total["hits"] == 2 + 8 + 2  # distinct per call
    # Layer 1's 4..11 were loaded before it ran, into the slots of the 8 experts no
    # layer was predicted to use (layer 0's 2, 3, its own 0..3, layer 2's 0, 1).
    assert total["prefetched"] == 8 and total["loads"] == 8
    per_layer = engine.stats()["resident_per_layer"]
    assert per_layer[NAMES[1]] >= 8 and sum(per_layer.values()) <= LAYERS * 4
    for name in NAMES:
        check_cache_invariants(engine.layers[name].loader, settle=True)

    for other in (make_engine(cache="lru"), make_engine(plec_preload="none")):
        run_step(other, routes, demand_of(routes, 4))
        assert other.stats()["total"]["decode"]["misses"] > 0


def test_a_miss_evicts_what_no_prediction_needs_before_an_older_predicted_expert(make_engine):
    """Experts 0, 1 of layer 2 are predicted for this step and least recently used; a
    mispredicted miss in layer 1 must take an unpredicted slot instead."""
    engine = make_engine()
    both = np.array([[0, 1], [2, 3]])
    run_step(engine, {i: np.array([[2, 3]]) for i in range(LAYERS)}, None)
    run_step(engine, {i: np.array([[0, 1]]) for i in range(LAYERS)}, None)
    run_step(engine, {0: both, 1: both, 2: np.array([[2, 3]])}, None)
    # Now layer 2's 0 and 1 are the least recently used of the pool.
    routes = {0: np.array([[2, 3]]), 1: np.array([[9, 10]]), 2: np.array([[0, 1]])}
    predicted = {0: np.array([[2, 3]]), 1: np.array([[2, 3]]), 2: np.array([[0, 1]])}
    run_step(engine, routes, demand_of(predicted, 1))
    assert {0, 1} <= resident(engine, 2)
    layer2 = engine.layers[NAMES[2]].stats.decode
    assert layer2.misses == 0


def test_among_unpredicted_experts_the_layer_whose_turn_is_farthest_goes_first(make_engine):
    """Layers run 0, 1, 2, 0, ...: with no prediction, a miss in layer 1 takes its own
    unused slots (its turn is a whole step away) before those of layers 2 and 0, even
    when theirs were used longer ago (plain LRU would take layer 0's, next but one)."""
    engine = make_engine(plec_preload="none")
    assert all(resident(engine, i) == {0, 1, 2, 3} for i in range(LAYERS))
    run_step(
        engine, {0: np.array([[0, 1]]), 1: np.array([[0, 1], [2, 3]]), 2: np.array([[2, 3]])}, None
    )
    DemandSource.of(engine).demand = None
    name = NAMES[1]
    ids = torch.tensor([[9, 10]], dtype=torch.int32)
    engine.run_call(
        LayerCall(
            NAMES[0],
            slot_kernel,
            torch.randn(1, H).bfloat16(),
            torch.ones(1, K) / K,
            torch.tensor([[0, 1]], dtype=torch.int32),
        )
    )
    engine.run_call(
        LayerCall(name, slot_kernel, torch.randn(1, H).bfloat16(), torch.ones(1, K) / K, ids)
    )
    assert resident(engine, 0) == {0, 1, 2, 3} and resident(engine, 2) == {0, 1, 2, 3}
    assert {9, 10} <= resident(engine, 1) and len(resident(engine, 1)) == 4


@pytest.mark.parametrize(
    "seed,link",
    [
        (0, {}),
        (1, {}),
        # Emulated: loads queue on the link, and a slot taken from a queued preload cancels
        # that copy (an expert not copied must not stay resident).
        (2, {"bandwidth_gbps": 0.05, "latency_us": 50}),
    ],
)
def test_exact_and_within_budget_through_random_steps_and_wrong_predictions(
    make_engine, seed, link
):
    rng = np.random.default_rng(seed)
    engine = make_engine(link=link)
    shares = set()
    for step in range(30):
        tokens = int(rng.integers(1, 6))
        routes = {i: distinct(rng, tokens) for i in range(LAYERS)}
        # Half right, half random predictions; a next group now and then.
        guess = {
            i: routes[i] if rng.random() < 0.5 else distinct(rng, tokens) for i in range(LAYERS)
        }
        nxt = {i: distinct(rng, 3) for i in range(LAYERS)} if step % 3 == 0 else None
        run_step(engine, routes, demand_of(guess, tokens, nxt) if step % 5 else None, seed=step)
        for name in NAMES:
            check_cache_invariants(engine.layers[name].loader)
        shares.add(tuple(len(resident(engine, i)) for i in range(LAYERS)))
    assert len(shares) > 1, "slots never moved between layers"
    stats = engine.stats()["total"]["decode"]
    assert stats["prefetched"] > 0 and stats["misses"] > 0


def test_next_group_is_loaded_after_its_layer_ran(make_engine):
    """With the token scheduler's next group in the demand, each layer loads that
    group's predicted experts once it has run this step."""
    engine = make_engine()
    now = {i: np.array([[0, 1]]) for i in range(LAYERS)}
    nxt = {i: np.array([[12, 13]]) for i in range(LAYERS)}
    run_step(engine, now, demand_of(now, 1, nxt))
    for i in range(LAYERS):
        assert {12, 13} <= resident(engine, i)
    engine.reset_stats()
    run_step(engine, nxt, demand_of(nxt, 1))
    assert engine.stats()["total"]["decode"]["misses"] == 0


def test_a_shared_pool_past_the_kernels_reach_splits_into_runs_of_layers(toy_engines):
    # A slot's widest tensor is w13's, 2 x 16 x 32 = 1024 elements; a kernel that
    # addresses 8 slots' worth takes two layers of 4 slots per pool: pools of 8 and 4.
    config = {"budget": 0.25, "cache": "plec", "plec_preload": "none", "path_predictor": "/rpp"}
    engine = toy_engines(config, layers(), K, pool_reach=8 * 1024)
    pools = engine.pools.pools
    assert [p.num_slots for p in pools] == [8, 4]
    assert [engine.layers[n].cache.pool for n in NAMES] == [pools[0], pools[0], pools[1]]
    assert all(t.numel() <= 8 * 1024 for p in pools for t in p.tensors.values())
    assert "2 pools of 8/4 slots" in engine.summary()
    rng = np.random.default_rng(5)
    routes = {i: distinct(rng, 2) for i in range(LAYERS)}
    run_step(engine, routes, demand_of(routes, 2))  # exact, in either pool
    # The step's plan reached every pool: each layer's demand is its own pool's row.
    for index, name in enumerate(NAMES):
        cache = engine.layers[name].cache
        expected = np.bincount(routes[index].ravel(), minlength=E)
        assert (cache.pool.predicted_uses[cache.index] == expected).all()
        check_cache_invariants(engine.layers[name].loader, settle=True)


def test_reconfigure_between_plec_and_lru_keeps_outputs_exact(make_engine):
    engine = make_engine()
    rng = np.random.default_rng(3)
    routes = {i: distinct(rng, 2) for i in range(LAYERS)}
    run_step(engine, routes, demand_of(routes, 2))
    engine.reconfigure(engine.config.changed({"cache": "lru"}))
    assert engine.pools is None and engine.layers[NAMES[0]].cache.pool.shared is False
    run_step(engine, routes, demand_of(routes, 2))
    # lru reset plec_preload (no effect there): it is given again with plec.
    assert engine.config.plec_preload == "none"
    engine.reconfigure(engine.config.changed({"cache": "plec", "plec_preload": "next"}))
    assert engine.pools is not None and engine.pools.pools[0].num_slots == LAYERS * 4
    run_step(engine, routes, demand_of(routes, 2))
    # At most 4 experts per layer, 12 together: a right prediction leaves no miss
    # after the first layer (which loads what its router chose).
    layers = engine.stats()["layers"]
    assert [layers[n]["decode"]["misses"] for n in NAMES[1:]] == [0, 0]


def test_a_prefetch_during_a_call_never_evicts_the_experts_its_kernel_is_about_to_run(make_engine):
    """The next layer's prefetch is submitted after a call acquired its experts and
    before its kernel starts; in a shared pool its victims may be the running layer's.
    The experts of the launch must stay where the kernel will read them."""
    from moe_reference import run_fetch  # noqa: F401 (the same executor path)

    from vllm_specexpert import layer_call
    from vllm_specexpert.device_runs import device_run_for
    from vllm_specexpert.stats import PhaseStats

    engine = make_engine(plec_preload="none")
    running, upcoming = engine.layers[NAMES[0]], engine.layers[NAMES[1]]
    ids = torch.tensor([[4, 5]], dtype=torch.int32)
    x, w = torch.randn(1, H).bfloat16(), torch.tensor([[0.7, 0.3]])
    stats = PhaseStats()
    # Victims of the upcoming layer's load: its own experts first, then the running
    # layer's (whose turn comes next-to-last), oldest first, then the last layer's.
    first = layer_call.FirstLaunch()
    first.add(lambda: upcoming.loader.prefetch(np.arange(8, 16), stats))
    call = layer_call.LayerCall(NAMES[0], slot_kernel, x, w, ids, first_launch=first)
    call = call.on_host(stats)
    device, loader = device_run_for(), running.loader
    out = device.run_all(loader, call)
    t = LAYER_TENSORS[NAMES[0]]
    assert torch.equal(out, reference_moe(x, w, ids, t["w13_weight"], t["w2_weight"]))
    assert stats.prefetched > 0  # the prefetch did take slots of the shared pool
    for layer in engine.layers.values():
        check_cache_invariants(layer.loader, settle=True)


def test_prefetches_of_other_layers_always_leave_room_for_one_token(make_engine):
    """In a shared pool, protected prefetches of other layers could fill every slot a
    call can take; a prefetch leaves top_k of them, so one token of any layer runs."""
    engine = make_engine(plec_preload="none")
    stats = engine.layers[NAMES[0]].stats.decode
    for name in NAMES[1:]:
        engine.layers[name].loader.prefetch(np.arange(4, 16), stats)
    protected = sum(int(engine.layers[n].cache.protected.sum()) for n in NAMES)
    # The prefetches wanted 24 slots of 12: they took all but the reserve of top_k.
    assert protected == engine.pools.pools[0].num_slots - K
    first = engine.layers[NAMES[0]].cache
    assert not first.resident_mask()[[14, 15]].any()
    assert engine.pools.pools[0].available_for(first, np.array([14, 15])) == K
    # One token of layer 0 whose experts are both missing loads them and runs exactly.
    ids = torch.tensor([[14, 15]], dtype=torch.int32)
    x, w = torch.randn(1, H).bfloat16(), torch.tensor([[0.6, 0.4]])
    out = engine.run_call(LayerCall(NAMES[0], slot_kernel, x, w, ids))
    t = LAYER_TENSORS[NAMES[0]]
    assert torch.equal(out, reference_moe(x, w, ids, t["w13_weight"], t["w2_weight"]))
    assert first.resident_mask()[[14, 15]].all()
    assert sum(int(engine.layers[n].cache.protected.sum()) for n in NAMES[1:]) == protected
    rng = np.random.default_rng(0)
    run_step(engine, {i: distinct(rng, 3) for i in range(LAYERS)}, None)
    for name in NAMES:
        check_cache_invariants(engine.layers[name].loader, settle=True)


def test_calibration_vectors_given_after_the_layers_joined_keep_the_shared_pool(make_engine):
    """The vLLM adapter hands the engine a calibration's vectors once every layer is
    loaded (and has joined the shared pool); that must not replace the pool."""
    engine = make_engine(plec_preload=None, predictor="quasi_hidden", calibration="/c", start=False)
    pool = engine.pools.pools[0]
    engine.provide(
        predictor_inputs=PredictorInputs(
            {n: torch.zeros(E, H) for n in NAMES}, {n: torch.ones(H) for n in NAMES}
        )
    )
    engine.start()
    assert engine.pools.pools[0] is pool and pool.num_slots == LAYERS * 4
    assert engine.feature(PredictionFeature).predictor.name == "quasi_hidden"
    rng = np.random.default_rng(1)
    run_step(engine, {i: distinct(rng, 2) for i in range(LAYERS)}, None)


def test_plec_under_a_quality_budget_starts_in_the_pool_its_layers_joined(make_engine):
    # The vLLM adapter's order: layers added, the model's logit head given (quality),
    # then start. Handing the head over once rebuilt the shared pool, empty: start
    # failed with an IndexError (issue 37).
    from test_quality import identity_head

    engine = make_engine(plec_preload=None, miss_policy="drop", quality={}, start=False)
    engine.provide(logit_head=identity_head(H))
    engine.start()
    assert engine.feature(QualityFeature) is not None
    assert all(engine.layers[name].cache.pool is engine.pools.pools[0] for name in NAMES)
    assert engine.pools.pools[0].num_slots == sum(engine.layers[n].cache.num_slots for n in NAMES)
    for index, name in enumerate(NAMES):  # (drop: approximate, so no reference here)
        ids = torch.from_numpy(distinct(np.random.default_rng(index), 3)).to(torch.int32)
        out = engine.run_call(
            LayerCall(
                name, slot_kernel, torch.randn(3, H).bfloat16(), torch.full(ids.shape, 0.5), ids
            )
        )
        assert out.shape == (3, H) and torch.isfinite(out).all()
        check_cache_invariants(engine.layers[name].loader, settle=True)
