"""Prediction, prefetch and speculative execution in the engine, without vLLM: a two-layer
toy model whose layers route with softmax top-k over a random gate."""

import itertools

import numpy as np
import pytest
import torch
from invariants import check_cache_invariants
from manual_clock import ManualClock
from moe_reference import make_loader, random_layer, reference_moe, slot_kernel

from vllm_specexpert.config import LinkConfig
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.phases import PassPhases
from vllm_specexpert.predict import (
    LayerState,
    NextLayerRouting,
    PredictorInputs,
    QuasiHiddenPredictor,
    residual_scale,
)
from vllm_specexpert.stats import PhaseStats
from vllm_specexpert.tiers.link import CpuLink

E, K, H = 16, 4, 32
NAMES = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def rms_norm(weight):
    return lambda h: (
        h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    ).to(h.dtype)


def softmax_topk(gate):
    def route(h):
        probs = torch.softmax(h.float() @ gate.T, -1)
        w, ids = probs.topk(K, -1)
        return (w / w.sum(-1, keepdim=True)), ids.to(torch.int32)

    return route


@pytest.fixture
def toy():
    g = torch.Generator().manual_seed(7)
    gates = [torch.randn(E, H, generator=g) for _ in NAMES]
    norms = [1 + 0.1 * torch.randn(H, generator=g) for _ in NAMES]
    layers = {name: random_layer(num_experts=E, hidden=H, seed=i) for i, name in enumerate(NAMES)}
    return gates, norms, layers


@pytest.fixture
def make_engine(toy_engines, toy):
    """``make_engine(**config)``: the ``toy`` model's layers under ``config``, the first
    linked to the second's router; not started (a predictor's inputs may come later, as
    from the vLLM adapter)."""

    def make(**config) -> OffloadEngine:
        gates, norms, layers = toy
        engine = toy_engines(config, layers, K, start=False)
        engine.link_layers(NAMES[0], NAMES[1])
        routing = NextLayerRouting(rms_norm(norms[1]), softmax_topk(gates[1]))
        engine.provide(next_routing={NAMES[0]: routing})
        return engine

    return make


def decode_stats(engine):
    return {name: layer["decode"] for name, layer in engine.stats()["layers"].items()}


def step(engine, toy, x0, phases=None):
    """Layer 0 routed by its router; layer 1's input is a fixed function of layer 0's
    output (stand-in for attention), routed by its router."""
    gates, norms, _ = toy
    w0, ids0 = softmax_topk(gates[0])(x0)
    out0 = engine.run_call(LayerCall(NAMES[0], slot_kernel, x0, w0, ids0, phases))
    x1 = rms_norm(norms[1])((x0.float() + out0.float()).bfloat16())
    w1, ids1 = softmax_topk(gates[1])(x1)
    out1 = engine.run_call(LayerCall(NAMES[1], slot_kernel, x1, w1, ids1, phases))
    return out0, (x1, w1, ids1), out1


def tokens(n, seed):
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_router_prefetch_keeps_fetch_exact_and_counts(make_engine, toy):
    engine = make_engine(budget=0.5, predictor="router")
    _, _, layers = toy
    for s in range(6):
        _, (x1, w1, ids1), out1 = step(engine, toy, tokens(2, s))
        expected = reference_moe(x1, w1, ids1, *layers[NAMES[1]].values())
        assert torch.equal(out1, expected)
    stats = decode_stats(engine)
    first, second = stats[NAMES[0]], stats[NAMES[1]]
    assert first["prefetched"] == 0 and first["predicted"] == 0  # nothing predicts layer 0
    assert second["predicted"] == 6 * 2 * K
    assert 0 < second["predicted_correct"] <= second["predicted"]
    assert second["prefetched"] > 0
    assert second["prefetch_used"] + second["prefetch_unused"] == second["prefetched"]
    for layer in engine.layers.values():
        check_cache_invariants(layer.loader, settle=True)
    engine.close()


def test_speculate_runs_the_prediction_without_refetching(make_engine, toy):
    gates, _, layers = toy
    engine = make_engine(budget=0.5, predictor="router", miss_policy="speculate")
    for s in range(6):
        x0 = tokens(2, s)
        _, (x1, _, _), out1 = step(engine, toy, x0)
        w0, _ = softmax_topk(gates[0])(x0)
        predicted_w, predicted_ids = softmax_topk(gates[1])(x0)  # router predictor: s_0
        expected = reference_moe(
            x1, predicted_w.to(w0.dtype), predicted_ids, *layers[NAMES[1]].values()
        )
        assert torch.equal(out1, expected)
    second = decode_stats(engine)[NAMES[1]]
    assert second["speculated_calls"] == second["calls"] == 6
    assert second["misses"] == 0  # every executed expert was prefetched
    assert second["predicted_correct"] < second["predicted"]  # the toy's prediction is imperfect
    assert engine.stats()["output"] == "approximate"
    engine.close()


def test_exact_layers_keep_the_router(make_engine, toy):
    engine = make_engine(
        budget=0.5, predictor="router", miss_policy="speculate", exact_layers=[0, 1]
    )
    _, _, layers = toy
    _, (x1, w1, ids1), out1 = step(engine, toy, tokens(3, 0))
    assert torch.equal(out1, reference_moe(x1, w1, ids1, *layers[NAMES[1]].values()))
    assert decode_stats(engine)[NAMES[1]]["speculated_calls"] == 0
    engine.close()


def test_prefill_tokens_are_not_predicted_decode_tokens_are_whatever_their_number(make_engine, toy):
    engine = make_engine(budget=0.5, predictor="router")
    step(engine, toy, tokens(5, 0), PassPhases.prefill_only(5))
    assert engine.stats()["layers"][NAMES[1]]["prefill"]["predicted"] == 0
    step(engine, toy, tokens(96, 0), PassPhases.decode_only(96))
    assert decode_stats(engine)[NAMES[1]]["predicted"] == 96 * K
    # A mixed pass: only its 2 decode rows are predicted.
    step(engine, toy, tokens(7, 1), PassPhases(7, np.array([2, 5]), np.array([0, 1, 3, 4, 6])))
    assert decode_stats(engine)[NAMES[1]]["predicted"] == (96 + 2) * K
    engine.close()


def test_quasi_hidden_state_is_norm_of_estimated_residual_plus_default_vectors():
    g = torch.Generator().manual_seed(0)
    vectors = torch.randn(E, H, generator=g)
    residual = torch.randn(3, H, generator=g)  # r_l
    own_norm = torch.rand(H, generator=g) + 0.5  # layer l's post-attention norm weight
    router_input = rms_norm(own_norm)(residual)  # s_l as the model computes it
    rms = residual.pow(2).mean(-1).sqrt()
    ids = torch.tensor([[0, 1], [2, 3], [1, 5]])
    weights = torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])
    next_norm = torch.rand(H, generator=g) + 0.5
    captured = {}

    def route(q):
        captured["q"] = q
        return weights, ids

    # The calibrated mean RMS of r_l turns s_l back into r_l exactly when every token
    # has that RMS: here, give the predictor each token's own RMS in turn.
    d = torch.stack([sum(weights[t, k] * vectors[ids[t, k]] for k in range(2)) for t in range(3)])
    for t in range(3):
        predictor = QuasiHiddenPredictor(
            {"l": vectors}, {"l": residual_scale(own_norm, float(rms[t]))}
        )
        state = LayerState(router_input=router_input, topk_ids=ids, topk_weights=weights)
        predictor.predict(state, "l", NextLayerRouting(rms_norm(next_norm), route))
        expected = rms_norm(next_norm)(d + residual)
        torch.testing.assert_close(captured["q"][t], expected[t], rtol=1e-4, atol=1e-4)


def test_quasi_hidden_engine_predicts_from_the_router_input(make_engine, toy):
    gates, norms, _ = toy
    engine = make_engine(budget=0.5, predictor="quasi_hidden", calibration="unused")
    assert engine.stats()["predictor"] == "quasi_hidden"
    # Zero default vectors and unit scale: q = LN_1(s_0), the router predictor's input
    # up to layer 1's norm.
    engine.provide(
        predictor_inputs=PredictorInputs(
            {NAMES[0]: torch.zeros(E, H), NAMES[1]: torch.zeros(E, H)},
            {NAMES[0]: torch.ones(H), NAMES[1]: torch.ones(H)},
        )
    )
    x0 = tokens(2, 1)
    _, (_, _, ids1), _ = step(engine, toy, x0)
    _, expected = softmax_topk(gates[1])(rms_norm(norms[1])(x0))
    hits = (ids1.unsqueeze(-1) == expected.unsqueeze(-2)).any(-1).sum()
    assert decode_stats(engine)[NAMES[1]]["predicted_correct"] == int(hits)
    engine.close()


def test_prefetch_is_protected_until_the_layer_runs():
    loader = make_loader(random_layer(num_experts=E), num_slots=4, top_k=2)
    stats = PhaseStats()
    cache = loader.cache
    assert loader.prefetch(np.array([8, 9, 10]), stats) == 3
    assert set(cache.slot_expert) >= {8, 9, 10}
    # Another prefetch cannot evict them; only one slot is left.
    assert loader.prefetch(np.array([11, 12]), stats) == 1
    assert set(cache.slot_expert) == {8, 9, 10, 11}
    loader.begin_run(np.array([8, 11]), stats)
    assert stats.prefetch_used == 2 and stats.prefetch_unused == 2
    assert not cache.protected.any()
    loader.acquire(np.array([8, 11]), stats)
    assert stats.misses == 0
    check_cache_invariants(loader, settle=True)


def test_a_prefetch_evicts_the_least_likely_and_never_a_likelier_expert():
    loader = make_loader(random_layer(num_experts=E), num_slots=4, top_k=2)
    stats = PhaseStats()
    cache = loader.cache
    loader.acquire(np.array([0, 1, 2, 3]), stats)  # LRU order: 0 first, 3 last
    loader.begin_run(np.array([], dtype=np.int64), stats)
    chance = np.zeros(E)
    chance[[0, 1, 2, 3]] = [0.5, 0.0, 0.95, 0.1]  # what the next call may use
    chance[[5, 6]] = [0.9, 0.2]
    assert loader.prefetch(np.array([5, 6]), stats, likelihood=chance) == 2
    # 5 took the least likely (1), 6 the next (3, at 0.1 < 0.2); LRU would have taken 0
    # and 1, and 0 (0.5) is likelier than 6.
    assert sorted(cache.slot_expert.tolist()) == [0, 2, 5, 6]
    loader.begin_run(np.array([5]), stats)  # (6 unused: evictable again)
    chance[:] = 0.0
    chance[[0, 2, 5, 6]] = [0.5, 0.95, 0.3, 0.0]
    chance[[7, 8]] = [0.4, 0.35]
    # 7 may evict 6 (0.0) and 8 may evict 5 (0.3 < 0.35); nothing else is worth it.
    chance[9] = 0.45
    assert loader.prefetch(np.array([9, 7, 8]), stats, likelihood=chance) == 2
    assert sorted(cache.slot_expert.tolist()) == [0, 2, 7, 9]
    # Without a likelihood: the eviction order is the policy's (LRU), as before.
    loader.begin_run(np.array([], dtype=np.int64), stats)
    first = cache.policy.order(cache.evictable(np.array([10])))[0]
    assert loader.prefetch(np.array([10]), stats) == 1
    assert first not in cache.slot_expert.tolist()  # the policy's first victim went
    check_cache_invariants(loader, settle=True)


def test_a_real_link_moves_a_layers_prefetches_as_one_transfer():
    # A real link cannot drop a queued prefetch, so a layer's prefetches go to the slow
    # tier together (a disk reads them at its queue depth); the emulated link queues one
    # transfer per expert, each droppable until it starts.
    for config, transfers in ((LinkConfig(), 1), (LinkConfig(bandwidth_gbps=0.002), 3)):
        link = CpuLink(config, ManualClock())
        loader = make_loader(random_layer(num_experts=E), num_slots=6, top_k=2, link=link)
        assert loader.prefetch(np.array([10, 12, 14]), PhaseStats()) == 3  # (0-5 resident)
        assert len({id(t) for t in loader.prefetches.values()}) == transfers
        loader.wait_all()
        link.close()


def test_waiting_for_an_unfinished_prefetch_is_stall():
    # 2 MB/s: ~100 ms per expert, on a clock that moves only while the link is waited
    # for (at once to when the copy lands): the wait is the copy's time, whatever the load.
    clock = ManualClock()
    link = CpuLink(LinkConfig(bandwidth_gbps=0.002, latency_us=0), clock)
    tensors = random_layer(num_experts=E, hidden=256, inter=128)  # 196 KB per expert
    loader = make_loader(tensors, num_slots=4, top_k=2, link=link)
    stats = PhaseStats()
    loader.prefetch(np.array([8]), stats)
    assert not loader.ready_mask()[8]  # in flight when the layer's call starts
    loader.begin_run(np.array([8]), stats)
    loader.acquire(np.array([8]), stats)
    expected = loader.cache.experts.expert_nbytes / (link.config.bandwidth_gbps * 1e9)
    assert stats.misses == 0 and stats.hits == 1
    assert clock.now() == pytest.approx(expected, rel=1e-9)  # waited until it landed
    assert stats.stall_s == pytest.approx(expected, rel=1e-9)  # and all of it is stall
    assert check_cache_invariants(loader) == 4  # 8 landed: all four slots compared
    link.close()


def test_planner_learns_per_rank_precision_and_filters_by_cost():
    from vllm_specexpert.planner.prefetch import PrefetchPlanner, worth_threshold

    planner = PrefetchPlanner(top_k=2)
    # rank 1 is always right, rank 2 always wrong
    for _ in range(300):
        planner.observe(np.array([[3, 9]]), np.array([[3, 4]]))
    assert planner.precision[0] > 0.99 and planner.precision[1] < 0.01
    # Precision learns only from entries that were prefetch candidates (not resident).
    before = planner.precision.copy()
    planner.observe(np.array([[3, 9]]), np.array([[7, 8]]), considered=np.array([[False, False]]))
    assert np.allclose(planner.precision, before)
    # A slow link (copy 3x the window): only near-certain experts are worth it.
    threshold = worth_threshold(copy_s=3.0, window_s=1.0)
    assert threshold == 0.75
    wanted, skipped = planner.plan(np.array([[5, 6]]), threshold)
    assert wanted.tolist() == [5] and skipped.tolist() == [6]
    assert sorted(planner.plan(np.array([[5, 6]]), None)[0].tolist()) == [5, 6]
    # A fast link (copy within the window): break-even at one half.
    assert worth_threshold(copy_s=1.0, window_s=4.0) == 0.5


def test_planner_combines_tokens_that_predict_the_same_expert():
    from vllm_specexpert.planner.prefetch import PrefetchPlanner

    planner = PrefetchPlanner(top_k=2)
    planner.correct, planner.total = np.array([0.9, 0.4]), np.array([1.0, 1.0])
    # Expert 7 is predicted at rank 2 by two tokens: 1 - 0.6 * 0.6 = 0.64.
    wanted, _ = planner.plan(np.array([[1, 7], [2, 7]]), threshold=0.6)
    assert wanted.tolist() == [1, 2, 7]
    wanted, skipped = planner.plan(np.array([[1, 7], [2, 8]]), threshold=0.6)
    assert wanted.tolist() == [1, 2] and sorted(skipped.tolist()) == [7, 8]


def test_on_the_disk_tier_a_prefetch_that_reads_more_than_none_stops():
    # The judge by bytes (the disk tier's): a prefetch whose reads are used reads what
    # the calls would have (a tie: it goes on); one never used is a read more, so after
    # the first the layer is predicted no more (as the prediction feature asks the
    # planner). The precision is left at its prior (never scored): the judge alone stops
    # it.
    from vllm_specexpert.planner.bytes_judge import BytesJudge
    from vllm_specexpert.planner.prefetch import PredictionCounters, PrefetchPlanner
    from vllm_specexpert.predict import Prediction

    def steps(predicted) -> PhaseStats:
        loader = make_loader(random_layer(num_experts=E), num_slots=4, top_k=2)
        planner = PrefetchPlanner(top_k=2, judge=BytesJudge(E, 4))
        stats = PhaseStats()
        for step in range(6):
            used = np.array([4, 5]) + 2 * (step % 3)
            if planner.predicts:
                ids = torch.tensor([predicted(used)])
                prediction = Prediction(torch.full((1, 2), 0.5), ids)
                planner.prefetch(prediction, loader, stats, 1.0, False)
            loader.begin_run(used, stats)
            loader.acquire(used, stats)
            planner.judge_call(loader, used[None], stats)
        check_cache_invariants(loader, settle=True)
        return stats

    right = steps(lambda used: used.tolist())
    assert right.prefetched == 12 and right.misses == 0
    assert right.part(PredictionCounters).prefetch_judged_off == 0
    wrong = steps(lambda used: [12, 13])
    assert wrong.prefetched == 2  # (the first: nothing was judged yet)
    counters = wrong.part(PredictionCounters)
    assert counters.prefetch_judged_off == 6  # (the verdict after each call)
    assert counters.ghost_loads_prefetching > counters.ghost_loads_not_prefetching


def test_a_layer_judged_off_by_bytes_is_not_predicted(make_engine, toy):
    # The feature asks the next layer's planner before predicting it: judged off, the
    # router predictor's work for it is not done, and nothing is read ahead for it.
    from vllm_specexpert.features.prediction import PredictionFeature
    from vllm_specexpert.planner.bytes_judge import BytesJudge

    engine = make_engine(budget=0.25, predictor="router", prefetch_governor=False)
    engine.start()
    feature = engine.feature(PredictionFeature)
    planner = feature.planners[NAMES[1]]
    planner.judge = BytesJudge(E, engine.layers[NAMES[1]].cache.num_slots)  # (the disk's)
    counts = []
    for s in range(12):
        step(engine, toy, tokens(2, s))
        stats = decode_stats(engine)[NAMES[1]]
        counts.append((planner.judged_on, stats["predicted"], stats["prefetched"]))
    off = [index for index, (on, _, _) in enumerate(counts) if not on]
    assert off, counts  # (the toy's predictions miss: some of its reads are wasted)
    for before, after in itertools.pairwise(off):
        if after == before + 1:  # a call after an off verdict: nothing predicted or read
            assert counts[after][1:] == counts[before][1:], counts
    engine.close()


def test_unneeded_prefetches_that_have_not_started_are_cancelled():
    # ~100 ms per expert, on a clock that stands still until the link is waited for: 10
    # cannot start before begin_run, however long the test thread is descheduled.
    link = CpuLink(LinkConfig(bandwidth_gbps=0.002, latency_us=0), ManualClock())
    tensors = random_layer(num_experts=E, hidden=256, inter=128)
    loader = make_loader(tensors, num_slots=4, top_k=2, link=link)
    stats = PhaseStats()
    cache = loader.cache
    assert loader.prefetch(np.array([8, 9, 10]), stats) == 3  # 8 starts, 9 and 10 queue
    loader.begin_run(np.array([9, 3]), stats)  # 9 is needed; 8 already moving; 10 can go
    assert stats.prefetch_used == 1
    assert stats.prefetch_unused == 1 and stats.prefetch_cancelled == 1
    assert cache.expert_slot[10] == -1 and 10 not in cache.slot_expert
    loader.acquire(np.array([9, 3]), stats)  # 3 stayed resident
    assert stats.prefetched == 2  # 8 and 9 started by now; 10 never
    assert link.bytes_copied == 2 * cache.experts.expert_nbytes  # 8 and 9 moved, 10 never
    check_cache_invariants(loader, settle=True)
    link.close()


def test_a_decode_layer_call_reads_the_device_once(make_engine, toy, host_reads):
    # On CUDA every host read of a device tensor synchronizes with the compute stream.
    # The packed reader (the CUDA path) run on the CPU: router ids, the prediction for
    # the next layer and its weights must come back in one read, with misses, hits and
    # prefetches along the way.
    engine = make_engine(budget=0.5, predictor="router")
    engine.reader.packed = True  # (the pipelines hold this reader)
    gates, norms, _ = toy
    reads = host_reads
    reads.clear()
    per_call = []
    for s in range(6):
        x0 = tokens(2, s)
        w0, ids0 = softmax_topk(gates[0])(x0)
        reads.clear()
        out0 = engine.run_call(LayerCall(NAMES[0], slot_kernel, x0, w0, ids0))
        per_call.append(len(reads))
        x1 = rms_norm(norms[1])((x0.float() + out0.float()).bfloat16())
        w1, ids1 = softmax_topk(gates[1])(x1)
        reads.clear()
        engine.run_call(LayerCall(NAMES[1], slot_kernel, x1, w1, ids1))
        per_call.append(len(reads))
    assert per_call == [1] * 12
    second = decode_stats(engine)[NAMES[1]]
    assert second["prefetched"] > 0 and second["misses"] > 0
    engine.close()


@pytest.mark.parametrize("dear", [True, False], ids=["prefetch-dearer", "prefetch-cheaper"])
def test_the_prefetch_switch_stops_prefetching_where_a_pass_costs_more_with_it(
    make_engine, toy, dear
):
    # On a clock that charges a pass 1.5 s a token with prefetch and 1 s without (or the
    # other way round), prefetching stops after the warm-up (or goes on): the switch
    # measures the whole pass, whatever a prefetch saves or costs inside it.
    from vllm_specexpert.features.prediction import PredictionFeature
    from vllm_specexpert.planner.switch import WARM_UP_STEPS, MeasuredSwitch

    engine = make_engine(budget=0.5, predictor="router")
    engine.start()
    feature = engine.feature(PredictionFeature)
    now = [0.0]
    feature.switch = MeasuredSwitch("prefetch", clock=lambda: now[0])
    on_cost, off_cost = (1.5, 1.0) if dear else (1.0, 1.5)
    choices, prefetched = [], {True: 0, False: 0}
    for s in range(40):
        before = decode_stats(engine)[NAMES[1]]["prefetched"]
        step(engine, toy, tokens(2, s))
        choices.append(feature.prefetching)
        prefetched[feature.prefetching] += decode_stats(engine)[NAMES[1]]["prefetched"] - before
        now[0] += 2 * (on_cost if feature.prefetching else off_cost)
    measured = engine.stats()["prediction"]["prefetch_switch"]["2"]
    assert measured == {"on_s_per_token": on_cost, "off_s_per_token": off_cost}
    (family,) = feature.series()  # what /metrics serves of it
    assert sorted(family.samples) == [(("2", "off"), off_cost), (("2", "on"), on_cost)]
    assert choices[: 2 * WARM_UP_STEPS] == [True] * WARM_UP_STEPS + [False] * WARM_UP_STEPS
    after_warm_up = choices[2 * WARM_UP_STEPS :]
    assert not any(after_warm_up) if dear else all(after_warm_up), choices
    # Switched on, the planner prefetched; switched off, nothing was loaded ahead.
    assert prefetched[True] > 0 and prefetched[False] == 0
    engine.close()
