"""The clairvoyant bound the disk benchmark compares its caches with: Belady's MIN and
LRU on hand-worked sequences, and MIN never above LRU on random ones."""

import importlib.util
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

spec = importlib.util.spec_from_file_location(
    "clairvoyant", Path(__file__).parent.parent / "benchmarks" / "clairvoyant.py"
)
assert spec is not None and spec.loader is not None
clairvoyant = importlib.util.module_from_spec(spec)
spec.loader.exec_module(clairvoyant)


def test_belady_and_lru_on_a_worked_sequence():
    # Capacity 2. MIN: 1m 2m 3m (evict 2: next used at 4, 1 at 3) 1h 2m (evict 3: never
    # used again) 4m (evict 2: never again; 1 is, at 6) 1h -> 5 misses.
    # LRU: 1m 2m 3m (evict 1) 1m (evict 2) 2m (evict 3) 4m (evict 1) 1m -> 7 misses.
    sequence = [1, 2, 3, 1, 2, 4, 1]
    counted = [True] * len(sequence)
    assert clairvoyant.belady_misses(sequence, counted, 2) == 5
    assert clairvoyant.lru_misses(sequence, counted, 2) == 7


def test_only_counted_positions_count_and_a_call_loads_an_expert_once():
    sequence, decode = clairvoyant.flatten(
        [(np.array([[3, 1], [1, 3]]), False), (np.array([[1, 2]]), True)]
    )
    assert sequence == [1, 3, 1, 2] and decode == [False, False, True, True]
    # Capacity 2, MIN: 1m 3m | 1h 2m(counted) -> 1 counted miss.
    assert clairvoyant.belady_misses(sequence, decode, 2) == 1


@given(st.lists(st.integers(0, 9), max_size=60), st.integers(1, 6))
def test_min_is_never_above_lru(sequence, capacity):
    counted = [True] * len(sequence)
    distinct = len(set(sequence))
    best = clairvoyant.belady_misses(sequence, counted, capacity)
    # Every expert is loaded once at least; no cache of that size loads fewer than MIN.
    assert distinct <= best <= clairvoyant.lru_misses(sequence, counted, capacity)


def test_a_replay_may_start_from_the_engines_resident_experts():
    # Capacity 2, holding 1 and 2 (2 the more recent). MIN: 1h 3m (evict 2: never used
    # again) 1h -> 1 miss; from empty it would be 2. LRU: 1h 3m (evict 2) 1h -> 1.
    sequence, counted = [1, 3, 1], [True] * 3
    assert clairvoyant.belady_misses(sequence, counted, 2, initial=[1, 2]) == 1
    assert clairvoyant.belady_misses(sequence, counted, 2) == 2
    assert clairvoyant.lru_misses(sequence, counted, 2, initial=[1, 2]) == 1
    # LRU's initial order matters: 2 then 1 (1 the more recent) -> 3 evicts 2 as well;
    # 3 then 2 -> 1 misses (evicts 3), 3 misses (evicts 2), 1 hits: 2 misses.
    assert clairvoyant.lru_misses(sequence, counted, 2, initial=[3, 2]) == 2


@given(
    st.lists(st.integers(0, 9), max_size=60),
    st.integers(1, 6),
    st.lists(st.integers(0, 9), unique=True, max_size=6),
)
def test_min_is_never_above_lru_from_the_same_start(sequence, capacity, initial):
    initial = initial[:capacity]
    counted = [True] * len(sequence)
    best = clairvoyant.belady_misses(sequence, counted, capacity, initial)
    assert best <= clairvoyant.lru_misses(sequence, counted, capacity, initial)
    assert best >= len(set(sequence) - set(initial))


def test_the_benchmark_records_each_call_as_it_was_and_its_read_once_bound(
    toy_engines, monkeypatch
):
    # vLLM's routing buffer is reused: a pass writes over the ids of the one before. The
    # recording keeps each call's ids as they were (a view would make every call the
    # last one's), and the read-once bound counts what each decode call missed.
    import torch
    from moe_reference import random_layer, slot_kernel

    from vllm_specexpert.engine import OffloadEngine
    from vllm_specexpert.layer_call import LayerCall

    bench = importlib.util.spec_from_file_location(
        "disk_vs_llamacpp", Path(__file__).parent.parent / "benchmarks" / "disk_vs_llamacpp.py"
    )
    module = importlib.util.module_from_spec(bench)
    bench.loader.exec_module(module)
    monkeypatch.setattr(OffloadEngine, "run_call", OffloadEngine.run_call)  # (undone after)
    name = "model.layers.0.mlp.experts"
    engine = toy_engines({"budget": 0.5}, {name: random_layer(num_experts=16, hidden=32)}, 4)
    recorder, buffer = module.RouteRecorder(), torch.zeros(1, 4, dtype=torch.int32)
    x, weights = torch.randn(1, 32).bfloat16(), torch.full((1, 4), 0.25)
    with recorder.recording():
        for ids in ([0, 1, 8, 9], [0, 1, 8, 10], [2, 3, 4, 5]):  # (0-7 resident at first)
            buffer[0] = torch.tensor(ids)
            engine.run_call(LayerCall(name, slot_kernel, x, weights, buffer))
    recorded = [call.tolist() for call, _ in recorder.calls[name]]
    assert recorded == [[[0, 1, 8, 9]], [[0, 1, 8, 10]], [[2, 3, 4, 5]]]
    # 8, 9 evict 2, 3 (the least recent, then the lowest id); 10 evicts 4: 2, 3, 4 again.
    assert recorder.read_once[name] == 2 + 1 + 3 == engine.stats()["total"]["decode"]["loads"]


def test_a_pooled_replay_keeps_layers_apart_and_lends_one_layers_room_to_another():
    # Layer 0 alternates experts 0 and 1, layer 1 uses expert 0 only; each call's misses
    # read bytes (decode), 10 per expert of layer 0 and 1 of layer 1.
    calls = [(0, np.array([0]), True), (1, np.array([0]), True), (0, np.array([1]), True)] * 3
    sequence, decode = clairvoyant.flatten_pooled(calls, experts_per_layer=4)
    assert decode == [True] * 9
    assert sequence == [0, 4, 1] * 3  # (layer 1's expert 0 is pair 4, not layer 0's 0)
    weights = [10.0 if pair < 4 else 1.0 for pair in sequence]
    # Three pooled slots hold all three pairs: each read once (10 + 1 + 10).
    assert clairvoyant.belady_misses(sequence, weights, 3) == 21
    # One slot a layer (2 in all, as two caches): layer 0 reads at each of its 6 calls.
    per_layer = clairvoyant.belady_misses([0, 1] * 3, [10.0] * 6, 1) + 1.0
    assert per_layer == 61
    # Pooled at 2 (the same room as one slot each), the layers share it: 42 bytes.
    assert clairvoyant.belady_misses(sequence, weights, 2) == 42
