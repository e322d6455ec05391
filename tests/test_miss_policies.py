"""Miss policies in the engine, without vLLM: one toy layer of 16 experts, top-4, 8 slots.
The warm start leaves experts 0-7 resident, so each test knows which entries miss."""

import time

import numpy as np
import pytest
import torch
from invariants import check_cache_invariants
from manual_clock import ManualClock
from moe_reference import random_layer, reference_moe, slot_kernel

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.features.host_compute import host_share
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.phases import PassPhases
from vllm_specexpert.places import Place
from vllm_specexpert.tiers.host import HostCostModel, torch_experts

E, K, H = 16, 4, 32
NAME = "model.layers.0.mlp.experts"
TENSORS = random_layer(num_experts=E, hidden=H, seed=3)
W13, W2 = TENSORS["w13_weight"], TENSORS["w2_weight"]


@pytest.fixture
def make_engine(toy_engines):
    """This file's one toy layer: ``make_engine(coactivation=None, host_kernel=slot_kernel,
    **config)`` is an engine at budget 0.5 (unless ``config`` says otherwise), with the
    calibration's ``coactivation`` counts when given."""

    def make(coactivation=None, host_kernel=slot_kernel, **config) -> OffloadEngine:
        engine = toy_engines(
            {"budget": 0.5, **config}, {NAME: TENSORS}, K, host_kernel=host_kernel, start=False
        )
        if coactivation is not None:
            engine.provide(routing_statistics={NAME: (coactivation, np.linspace(0, 1, 101))})
        engine.start()
        return engine

    return make


def routing(ids, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(ids, dtype=torch.int32)
    x = torch.randn(ids.shape[0], H, generator=g).bfloat16()
    w = torch.softmax(torch.randn(ids.shape, generator=g), -1)
    return x, w, ids


# Token 0: 1 resident (0), 3 missing. Token 1: all resident. Token 2: all missing.
IDS = [[0, 9, 10, 11], [1, 2, 3, 4], [12, 13, 14, 15]]


def assert_equivalent(a, b):
    """Equal up to bf16 rounding of partial sums: each of the two partial outputs is
    rounded once to bf16 (relative 2^-8) before they are added."""
    torch.testing.assert_close(a, b, rtol=0, atol=2 * 2**-8 * float(b.abs().max()))


def layer_stats(engine):
    """The layer's decode counters (``engine.run_call`` without phases: all decode)."""
    return engine.stats()["layers"][NAME]["decode"]


def test_drop_runs_resident_experts_with_renormalised_weights(make_engine):
    engine = make_engine(miss_policy="drop")
    x, w, ids = routing(IDS)
    out = engine.run_call(LayerCall(NAME, slot_kernel, x, w, ids))
    resident = ids < 8
    kept = torch.where(resident, w, 0.0)
    expected = reference_moe(x, kept / kept.sum(-1, keepdim=True).clamp_min(1e-20), ids, W13, W2)
    expected[2] = 0  # no resident expert: the routed part is dropped entirely
    assert torch.equal(out, expected)
    assert not torch.equal(out, reference_moe(x, w, ids, W13, W2))
    stats = layer_stats(engine)
    assert stats["dropped_entries"] == stats["missed_entries"] == 7
    assert stats["loads"] == 0 and stats["misses"] == 7  # 9-15 missed, none loaded
    assert engine.stats()["output"] == "approximate" and not engine.stats()["exact"]


def test_cpu_computes_misses_on_the_host_equal_to_fetch(make_engine):
    cpu = make_engine(miss_policy="cpu")  # no admission: the cache never changes
    fetch = make_engine(miss_policy="fetch")
    for step in range(3):
        x, w, ids = routing(IDS, seed=step)
        a = cpu.run_call(LayerCall(NAME, slot_kernel, x, w, ids))
        b = fetch.run_call(LayerCall(NAME, slot_kernel, x, w, ids))
        assert_equivalent(a, b)
        assert torch.equal(b, reference_moe(x, w, ids, W13, W2))
    stats = layer_stats(cpu)
    assert stats["host_entries"] == stats["missed_entries"] == 3 * 7
    assert stats["host_experts"] == 3 * 7 and stats["host_s"] > 0
    assert stats["loads"] == 0 and cpu.stats()["link"]["bytes"] == 0  # nothing moved
    assert cpu.layers[NAME].cache.resident_mask()[:8].all()
    assert cpu.stats()["output"] == "equivalent"
    fetched = layer_stats(fetch)
    assert fetched["fetched_entries"] == fetched["missed_entries"] >= 7 and fetched["loads"] >= 7


def test_cpu_admits_the_most_used_host_expert_on_an_idle_link(make_engine):
    engine = make_engine(miss_policy="cpu", admit_host_experts=True)
    x, w, ids = routing([[0, 9, 10, 11], [1, 9, 3, 4]])  # 9 serves two tokens
    first = engine.run_call(LayerCall(NAME, slot_kernel, x, w, ids))
    cache, loader = engine.layers[NAME].cache, engine.layers[NAME].loader
    assert cache.resident_mask()[9] and not cache.resident_mask()[[10, 11]].any()
    landing = loader.in_flight.get(int(cache.expert_slot[9]))
    if landing is not None:  # the copy thread lands it (waited for, not performed here)
        assert landing.done.wait(60)
    assert loader.ready_mask()[9]
    second = engine.run_call(LayerCall(NAME, slot_kernel, x, w, ids))  # 9 now runs on the device
    assert_equivalent(second, first)
    stats = layer_stats(engine)
    # 9 was used from the cache; the second call admitted 10 (ties: lowest id).
    assert stats["prefetch_used"] == 1 and stats["admitted"] == stats["loads"] == 2
    assert cache.resident_mask()[[9, 10]].all()
    assert stats["host_entries"] == 4 + 2 and stats["missed_entries"] == 4 + 2
    check_cache_invariants(loader, settle=True)


def test_cpu_computes_an_expert_still_in_flight_instead_of_waiting(make_engine):
    # One copy takes ~30 ms on this link, and the link's clock stands still between the
    # calls (however long the machine takes): the admitted expert 9 has not landed when
    # the next call comes, so the host computes it again and nothing waits for the link.
    engine = make_engine(
        miss_policy="cpu",
        admit_host_experts=True,
        link={"bandwidth_gbps": 1e-4, "host_slowdown": 1},
    )
    engine.link.clock = ManualClock(engine.link.clock.now())
    x, w, ids = routing([[0, 9, 10, 11], [1, 9, 3, 4]])
    engine.run_call(LayerCall(NAME, slot_kernel, x, w, ids))
    loader = engine.layers[NAME].loader
    assert loader.cache.resident_mask()[9] and not loader.ready_mask()[9]  # in flight
    engine.run_call(LayerCall(NAME, slot_kernel, x, w, ids))
    stats = layer_stats(engine)
    assert stats["admitted"] == 1  # the second call found the link busy
    assert stats["host_entries"] == 4 + 4 and stats["stall_s"] == 0


def test_cpu_with_an_emulated_host_is_held_to_the_slowdown(make_engine):
    # The host's computation is timed by a clock that only its kernel moves (1 ms a
    # call): what is charged is 200 x that, however loaded the machine is.
    timer = ManualClock()

    def host_kernel_of_one_ms(*args):
        timer.advance(1e-3)
        return slot_kernel(*args)

    engine = make_engine(
        miss_policy="cpu",
        host_kernel=host_kernel_of_one_ms,
        link={"bandwidth_gbps": 1.0, "host_slowdown": 200.0},
    )
    engine.layers[NAME].places["host"].host.timer = timer
    x, w, ids = routing(IDS)
    start = time.perf_counter()
    engine.run_call(LayerCall(NAME, slot_kernel, x, w, ids))
    elapsed = time.perf_counter() - start
    assert timer.now() == 1e-3  # one host computation
    assert layer_stats(engine)["host_s"] == pytest.approx(200 * 1e-3, rel=1e-9)
    # The host's result is usable 200 ms after the call started: the call cannot have
    # returned earlier (a lower bound that a loaded machine only moves away from).
    assert elapsed >= 200 * 1e-3


def test_buddy_substitutes_the_co_activated_resident_expert_and_fetches_the_rest(make_engine):
    # Expert 9's strongest peers: 5, then 6. Expert 10's only peer is 0 (token 0 already
    # uses 0): no buddy qualifies, 10 is fetched. 11 has no co-activation at all.
    coactivation = np.zeros((E, E), dtype=np.int64)
    coactivation[9, 5], coactivation[9, 6], coactivation[10, 0] = 5, 3, 4
    engine = make_engine(
        coactivation,
        miss_policy="buddy",
        calibration="unused",
        buddy={"alpha": 1.0, "tau": 0.0, "beta": 1.0},
    )
    x, w, ids = routing(IDS[:1])
    out = engine.run_call(LayerCall(NAME, slot_kernel, x, w, ids))
    expected_ids = torch.tensor([[0, 5, 10, 11]])
    assert torch.equal(out, reference_moe(x, w, expected_ids, W13, W2))
    stats = layer_stats(engine)
    assert stats["substituted_entries"] == 1 and stats["fetched_entries"] == 2
    assert stats["loads"] == 2


def test_a_layer_whose_place_waits_for_its_input_fails_a_planned_call_then_runs_it(
    toy_engines,
):
    # Each layer's policy is built with its place when its call is composed; before the
    # calibration's statistics arrive, ``buddy``'s layers have no ``substituted`` place:
    # a call that has to plan is refused naming it (not run as some other policy), and
    # the call runs once the feature is built with them.
    coactivation = np.zeros((E, E), dtype=np.int64)
    coactivation[9, 5] = 5
    config = {"budget": 0.5, "miss_policy": "buddy", "calibration": "unused"}
    config["buddy"] = {"alpha": 1.0, "tau": 0.0, "beta": 1.0}
    engine = toy_engines(config, {NAME: TENSORS}, K, start=False)
    x, w, ids = routing(IDS[:1])
    with pytest.raises(RuntimeError, match=r"miss_policy 'buddy'.*no place 'substituted'"):
        engine.run_call(LayerCall(NAME, slot_kernel, x, w, ids))
    engine.provide(routing_statistics={NAME: (coactivation, np.linspace(0, 1, 101))})
    engine.start()
    engine.run_call(LayerCall(NAME, slot_kernel, x, w, ids))
    assert layer_stats(engine)["substituted_entries"] == 1


def test_buddy_without_co_activation_counts_fails_at_start(make_engine):
    with pytest.raises(SpecExpertConfigError, match=r"field 'calibration'.*co-activation"):
        make_engine(miss_policy="buddy", calibration="unused")


def test_random_substitutes_resident_unused_experts_repeatably(make_engine):
    runs = []
    for _ in range(2):
        engine = make_engine(miss_policy="random", buddy={"tau": 0.0, "beta": 1.0, "rho": 4})
        x, w, ids = routing(IDS[:1])
        runs.append(engine.run_call(LayerCall(NAME, slot_kernel, x, w, ids)))
        assert layer_stats(engine)["substituted_entries"] == 3
        assert layer_stats(engine)["loads"] == 0
    assert torch.equal(runs[0], runs[1])  # seeded
    assert not torch.equal(runs[0], reference_moe(x, w, ids, W13, W2))


class FixedHost(Place):
    name = "host"

    def __init__(self, seconds_per_row):
        self.seconds_per_row = seconds_per_row

    def estimate(self, rows):
        return self.seconds_per_row * np.asarray(rows, dtype=float)


def test_auto_splits_misses_to_minimise_the_longer_of_link_and_host():
    # Missing experts 9 (1 row), 10 (4 rows), 11 (29 rows) at 0.1 s/row: host times .1,
    # .4, 2.9; one copy takes 1 s. Host gets j cheapest, link the rest:
    # j=0: max(0, 3)=3; j=1: max(.1, 2)=2; j=2: max(.5, 1)=1; j=3: max(3.4, 0)=3.4 -> j=2.
    ids = np.array([[9, 10, 0, 1]] + [[10, 11, 2, 3]] * 3 + [[11, 0, 1, 2]] * 26)
    missing = ids >= 8
    on_host = host_share(ids, missing, FixedHost(0.1), copy_seconds=1.0)
    assert set(ids[on_host].tolist()) == {9, 10}
    assert not on_host[missing & (ids == 11)].any() and not on_host[~missing].any()
    # At 0.03 s per copy, fetching everything is best: j=0: .09 < j=1: max(.1, .06).
    assert not host_share(ids, missing, FixedHost(0.1), copy_seconds=0.03).any()


def test_auto_in_the_engine_follows_the_costs(make_engine):
    slow_link = make_engine(miss_policy="auto", link={"bandwidth_gbps": 1e-4, "host_slowdown": 1})
    fast_link = make_engine(miss_policy="auto", link={"bandwidth_gbps": 1e3, "host_slowdown": 1000})
    # The host's cost is fixed (1 ms per expert), not measured: the split must not
    # depend on how loaded the machine is. The link's emulated cost is a formula.
    for engine in (slow_link, fast_link):
        engine.layers[NAME].places["host"].host.cost.fix(1e-3, 0.0)
    x, w, ids = routing(IDS)
    a = slow_link.run_call(LayerCall(NAME, slot_kernel, x, w, ids))
    b = fast_link.run_call(LayerCall(NAME, slot_kernel, x, w, ids))
    assert layer_stats(slow_link)["host_entries"] == 7  # a copy takes ~0.1 s: compute
    assert layer_stats(fast_link)["fetched_entries"] == 7  # copies take ~1 us: fetch
    assert torch.equal(b, reference_moe(x, w, ids, W13, W2))
    assert_equivalent(a, b)


def test_host_cost_model_recovers_a_linear_cost():
    model = HostCostModel()
    for experts, rows in [(1, 1), (1, 8), (3, 5), (2, 20)]:
        model.observe(experts, rows, 2e-4 * experts + 1e-5 * rows)
    np.testing.assert_allclose(model.coef, [2e-4, 1e-5], rtol=1e-3)
    np.testing.assert_allclose(model.seconds(np.array([0, 10])), [2e-4, 3e-4], rtol=1e-3)


def test_torch_host_kernel_matches_the_reference():
    x, w, ids = routing([*IDS, [3, 3, 5, 7]])  # a repeated expert within a token too
    expected = reference_moe(x, w, ids, W13, W2)
    # The torch kernel keeps the intermediate activations in bf16 (as fused GPU kernels
    # do); the reference keeps them in fp32.
    scale = float(expected.abs().max())
    torch.testing.assert_close(
        torch_experts(x, w, ids, TENSORS), expected, rtol=0, atol=2**-5 * scale
    )
    # up and gate swapped
    swapped = {"w13_weight": W13.roll(W13.shape[1] // 2, dims=1), "w2_weight": W2}
    wrong = torch_experts(x, w, ids, swapped)
    assert float((wrong - expected).abs().max()) > 2**-5 * scale  # the check can fail


def test_prefill_tokens_fetch_whatever_the_policy(make_engine):
    engine = make_engine(miss_policy="drop")
    x, w, ids = routing(IDS)
    assert torch.equal(
        engine.run_call(LayerCall(NAME, slot_kernel, x, w, ids, PassPhases.prefill_only(3))),
        reference_moe(x, w, ids, W13, W2),
    )
    stats = engine.stats()["layers"][NAME]
    assert stats["prefill"]["dropped_entries"] == 0 and stats["prefill"]["fetched_entries"] == 7
    assert stats["decode"]["calls"] == 0


def sweep(tokens: int, seed: int = 0) -> list[list[int]]:
    """``tokens`` tokens' top-4, together needing all 16 experts: two of them on the warm
    start's experts 0-7, the others drawn at random."""
    rng = np.random.default_rng(seed)
    ids = [[0, 1, 2, 3], [4, 5, 6, 7]]
    ids += [rng.choice(E, K, replace=False).tolist() for _ in range(tokens - 2)]
    assert len({e for row in ids for e in row}) == E
    return ids


@pytest.mark.parametrize("phases", [None, PassPhases.prefill_only(24)])
def test_stream_reads_each_missing_expert_once_and_equals_fetch_up_to_rounding(
    make_engine, monkeypatch, phases
):
    # 24 tokens need all 16 experts; 8 slots hold experts 0-7. fetch runs whole tokens in
    # groups that fit, reading an expert again for a later group; stream reads each of
    # 8-15 once, a token's experts then in different launches.
    from vllm_specexpert.tiers.loader import ExpertLoader

    read: list[int] = []
    load = ExpertLoader._load
    monkeypatch.setattr(
        ExpertLoader,
        "_load",
        lambda self, e, *a, **k: read.extend(e.tolist()) or load(self, e, *a, **k),
    )
    stream, fetch = make_engine(miss_policy="stream"), make_engine(miss_policy="fetch")
    x, w, ids = routing(sweep(24))
    a = stream.run_call(LayerCall(NAME, slot_kernel, x, w, ids, phases))
    assert sorted(read) == list(range(8, 16))  # each missing expert read once
    read.clear()
    b = fetch.run_call(LayerCall(NAME, slot_kernel, x, w, ids, phases))
    assert len(read) > 8  # (the groups read experts again, resident ones too)
    assert_equivalent(a, b)
    whole = (ids < 8).all(dim=1)  # every expert resident at the start: one launch, exact
    assert whole.any() and torch.equal(a[whole], b[whole])
    assert not torch.equal(a, b)  # (a split token's partial sums are rounded apart)
    assert stream.stats()["output"] == "equivalent"
    check_cache_invariants(stream.layers[NAME].loader, settle=True)


def clairvoyant():
    """The disk benchmark's replays (Belady's MIN), from ``benchmarks/``."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "clairvoyant", Path(__file__).parent.parent / "benchmarks" / "clairvoyant.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stream_keeps_a_full_pool_across_sweeps_and_reads_the_read_once_bound(make_engine):
    # Six steps, each needing all 16 experts. A step can read no fewer than the experts it
    # needs that are not resident at its start: with the pool full (8), 8 a step. A
    # residency that left slots empty after a sweep, or reread within one, reads more.
    engine = make_engine(miss_policy="stream")
    cache = engine.layers[NAME].loader.cache
    calls, bound = [], 0
    for step in range(6):
        ids = sweep(24, seed=step)
        bound += E - int(cache.resident_mask().sum())  # (all 16 needed)
        assert cache.resident_mask().sum() == 8  # the pool full at each step's start
        engine.run_call(LayerCall(NAME, slot_kernel, *routing(ids, seed=step)))
        calls.append((np.array(ids), True))
    loads = layer_stats(engine)["loads"]
    assert loads == bound == 6 * 8
    # Belady's MIN replayed on the same calls (the disk benchmark's bound) reads no fewer.
    replay = clairvoyant()
    sequence, counted = replay.flatten(calls)
    assert loads == replay.belady_misses(sequence, counted, 8, initial=range(8))


def test_stream_keeps_the_most_used_experts_across_sweeps_as_belady_does(toy_engines):
    # 64 experts, 16 slots (0-15 at the start). Experts 0-5 are needed by every call;
    # each step also needs 12 others, each once in the whole run. Every step needs 18
    # experts, more than the slots, so it streams through two windows of 4. Belady's MIN
    # keeps 0-5 and reads each of the others once; so does a residency that keeps the
    # most used. One that kept the last windows read (recency) would read 0-5 again at
    # every step.
    hot, slots = np.arange(6), 16
    layer = random_layer(num_experts=64, hidden=H, seed=3)
    engine = toy_engines({"budget": 0.25, "miss_policy": "stream"}, {NAME: layer}, K)
    cache = engine.layers[NAME].loader.cache
    assert cache.num_slots == slots and cache.resident_mask()[:slots].all()
    calls = [np.array([[0, 1, 2, 3], [2, 3, 4, 5]])]  # (fits: used once before the sweeps)
    for step in range(4):
        others = 16 + 12 * step + np.arange(12).reshape(4, 3)
        calls.append(np.vstack([np.column_stack([hot[:4], others]), [[4, 5, 0, 1]]]))
    for step, ids in enumerate(calls):
        engine.run_call(LayerCall(NAME, slot_kernel, *routing(ids.tolist(), seed=step)))
        assert cache.resident_mask()[hot].all()  # (kept after every sweep)
    loads = layer_stats(engine)["loads"]
    replay = clairvoyant()
    sequence, counted = replay.flatten([(ids, True) for ids in calls])
    assert loads == replay.belady_misses(sequence, counted, slots, initial=range(slots)) == 48
    check_cache_invariants(engine.layers[NAME].loader, settle=True)


@pytest.mark.parametrize(
    "ids, events",
    [
        # Every expert needed, 0-7 resident: the resident launch first (no slot spare),
        # then the pool in halves: 12-15 read while 8-11 compute.
        (
            sweep(24),
            [("launch", 0, 7), ("read", 8, 11), ("read", 12, 15), ("launch", 8, 11),
             ("launch", 12, 15)],
        ),
        # 9 experts (more than the 8 slots); of the resident, 0 only: 8-11 read (into
        # half the pool) while it computes, 12-15 while 8-11 compute.
        (
            [[0, 8, 9, 10], [11, 12, 13, 14], [0, 8, 13, 15]],
            [("read", 8, 11), ("launch", 0, 0), ("read", 12, 15), ("launch", 8, 11),
             ("launch", 12, 15)],
        ),
    ],
)  # fmt: skip
def test_stream_reads_the_next_window_while_the_one_before_computes(
    make_engine, monkeypatch, ids, events
):
    from vllm_specexpert.device_runs import kernel_launch
    from vllm_specexpert.tiers.loader import ExpertLoader

    seen: list[tuple[str, int, int]] = []
    load, launch = ExpertLoader._load, kernel_launch.launch

    def loaded(self, experts, *args, **kwargs):
        seen.append(("read", int(experts.min()), int(experts.max())))
        return load(self, experts, *args, **kwargs)

    def launched(loader, call, experts):
        seen.append(("launch", int(experts.min()), int(experts.max())))
        return launch(loader, call, experts)

    monkeypatch.setattr(ExpertLoader, "_load", loaded)
    monkeypatch.setattr(kernel_launch, "launch", launched)
    stream, fetch = make_engine(miss_policy="stream"), make_engine(miss_policy="fetch")
    x, w, t = routing(ids)
    out = stream.run_call(LayerCall(NAME, slot_kernel, x, w, t))
    assert seen == events
    assert_equivalent(out, fetch.run_call(LayerCall(NAME, slot_kernel, x, w, t)))
    assert not stream.layers[NAME].loader.cache.in_use.any()  # (all launched: none held)
    check_cache_invariants(stream.layers[NAME].loader, settle=True)


def test_stream_copies_the_next_window_while_the_window_before_computes(make_engine, monkeypatch):
    # 8-11 and 12-15 stream (every expert needed, 0-7 resident). 12-15's copy waits
    # until 8-11's launch has begun: a copy made in the calling thread before that
    # launch (the CPU link's demand copies) would wait for it in vain.
    import threading

    from vllm_specexpert.device_runs import kernel_launch
    from vllm_specexpert.tiers.link.base import ExpertCopy

    launched_8_11 = threading.Event()
    waited: list[bool] = []
    run, launch = ExpertCopy.run, kernel_launch.launch

    def copy(self, *args, **kwargs):
        if 12 in self.experts:
            waited.append(launched_8_11.wait(timeout=5))
        return run(self, *args, **kwargs)

    def launched(loader, call, experts):
        if 8 in experts:
            launched_8_11.set()
        return launch(loader, call, experts)

    monkeypatch.setattr(ExpertCopy, "run", copy)
    monkeypatch.setattr(kernel_launch, "launch", launched)
    engine = make_engine(miss_policy="stream")
    engine.run_call(LayerCall(NAME, slot_kernel, *routing(sweep(24))))
    assert waited == [True]


def test_stream_runs_a_call_that_fits_as_fetch_does(make_engine):
    stream, fetch = make_engine(miss_policy="stream"), make_engine(miss_policy="fetch")
    for step in range(3):  # (13 distinct experts: more than 8 slots; then what fits)
        x, w, ids = routing([[0, 9, 10, 11], [1, 2, 3, 4]] if step else IDS[:2], seed=step)
        a = stream.run_call(LayerCall(NAME, slot_kernel, x, w, ids))
        assert torch.equal(a, fetch.run_call(LayerCall(NAME, slot_kernel, x, w, ids)))
    assert layer_stats(stream)["loads"] == layer_stats(fetch)["loads"]
