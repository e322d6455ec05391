import json
import logging
import shutil
import threading

import numpy as np
import pytest
import torch
from invariants import check_cache_invariants
from moe_reference import random_layer, random_routing, reference_moe, slot_kernel

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.phases import PassPhases

NAMES = [f"model.layers.{i}.mlp.experts" for i in range(2)]


@pytest.fixture
def make_engine(toy_engines):
    """This file's toy model (two layers of 16 experts, top-4): ``make_engine(**config)``
    is an engine under ``config`` and its layers' tensors."""

    def make(**config) -> tuple[OffloadEngine, dict]:
        layers = {name: random_layer(seed=i) for i, name in enumerate(NAMES)}
        return toy_engines(config, layers, top_k=4), layers

    return make


def test_engine_runs_layers_exactly_and_keeps_phases_apart(make_engine):
    engine, layers = make_engine(budget=0.25)
    for step in range(4):
        for name, tensors in layers.items():
            x, w, ids = random_routing(2, 16, 4, seed=step)
            out = engine.run_call(
                LayerCall(name, slot_kernel, x, w, ids, PassPhases.decode_only(2))
            )
            assert torch.equal(out, reference_moe(x, w, ids, *tensors.values()))
    x, w, ids = random_routing(5, 16, 4, seed=9)
    engine.run_call(LayerCall(NAMES[0], slot_kernel, x, w, ids, PassPhases.prefill_only(5)))
    stats = engine.stats()
    assert set(stats["slots_per_layer"].values()) == {4}
    assert stats["decode_tokens"] == 4 * 2 and stats["prefill_tokens"] == 5
    first = stats["layers"][NAMES[0]]
    assert (first["decode"]["calls"], first["prefill"]["calls"]) == (4, 1)
    assert (first["decode"]["tokens"], first["prefill"]["tokens"]) == (8, 5)
    assert stats["layers"][NAMES[1]]["prefill"]["calls"] == 0
    assert stats["modeled"] is None  # no emulated link: nothing is modeled
    for layer in engine.layers.values():
        check_cache_invariants(layer.loader, settle=True)
    engine.close()


def test_mixed_pass_runs_each_phase_through_its_own_path(make_engine):
    """Decode rows go through the miss policy (``drop``: approximate), prefill rows run
    exactly; the rows of each phase are interleaved as vLLM may order them."""
    engine, layers = make_engine(budget=0.5, miss_policy="drop")
    w13, w2 = layers[NAMES[0]].values()
    # Resident after warm start: 0-7. Rows 0, 2 decode; rows 1, 3, 4 prefill (one prompt).
    ids = torch.tensor(
        [[0, 9, 1, 2], [0, 9, 1, 2], [3, 12, 13, 4], [12, 13, 14, 15], [5, 6, 7, 15]],
        dtype=torch.int32,
    )
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
    w = torch.softmax(torch.randn(5, 4, generator=torch.Generator().manual_seed(1)), -1)
    phases = PassPhases(5, np.array([0, 2]), np.array([1, 3, 4]))
    out = engine.run_call(LayerCall(NAMES[0], slot_kernel, x, w, ids, phases))
    exact = reference_moe(x, w, ids, w13, w2)
    assert torch.equal(out[[1, 3, 4]], exact[[1, 3, 4]])
    assert not torch.equal(out[[0, 2]], exact[[0, 2]])  # decode rows dropped their misses
    stats = engine.stats()["layers"][NAMES[0]]
    assert stats["decode"]["dropped_entries"] == 1 + 2
    assert stats["prefill"]["dropped_entries"] == 0
    assert stats["prefill"]["fetched_entries"] == 1 + 4 + 1
    assert stats["prefill"]["loads"] > 0 and stats["decode"]["loads"] == 0
    engine.close()


def test_a_prompt_beside_decoding_requests_does_not_push_out_their_experts(make_engine):
    # 12 slots, 0-11 resident. A decoding request's routing alternates between 0-3 and
    # 4-7 (its working set is both); a prompt arrives in chunks, one per pass, beside it.
    # Each pass runs its decode rows first, then the prompt's.
    engine, layers = make_engine(budget=0.75)
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
    w = torch.softmax(torch.randn(2, 4, generator=torch.Generator().manual_seed(1)), -1)

    def ids(*rows) -> torch.Tensor:
        return torch.tensor([list(range(r, r + 4)) for r in rows], dtype=torch.int32)

    def step(decode: int, prompt: int | None = None) -> None:
        if prompt is None:
            out = engine.run_call(LayerCall(NAMES[0], slot_kernel, x[:1], w[:1], ids(decode)))
            routing = ids(decode)
        else:
            routing = ids(decode, prompt)
            phases = PassPhases(2, np.array([0]), np.array([1]))
            out = engine.run_call(LayerCall(NAMES[0], slot_kernel, x, w, routing, phases))
        rows = len(routing)
        assert torch.equal(
            out, reference_moe(x[:rows], w[:rows], routing, *layers[NAMES[0]].values())
        )

    step(4), step(0)  # the working set: 0-7
    step(4, prompt=12)  # the prompt's 12-15 take the slots of 8-11 (never used)
    # The next chunk's 8-11 must take the slots of the prompt's 12-15, not of 4-7 (used
    # before the prompt's chunk in the pass before, so older by use).
    step(0, prompt=8)
    cache = engine.layers[NAMES[0]].cache
    assert (cache.expert_slot[np.arange(12)] >= 0).all()
    engine.reset_stats()
    step(4)
    assert engine.stats()["layers"][NAMES[0]]["decode"]["loads"] == 0
    engine.close()


def test_reconfigure_resizes_caches_and_validates_first(make_engine):
    engine, _ = make_engine(budget=0.25)
    engine.reconfigure(SpecExpertConfig.from_dict({"budget": 0.5, "cache": "lfu"}))
    assert set(engine.stats()["slots_per_layer"].values()) == {8}
    assert all(layer.cache.policy.name == "lfu" for layer in engine.layers.values())
    with pytest.raises(SpecExpertConfigError, match="top_k=4"):
        engine.reconfigure(SpecExpertConfig.from_dict({"budget": 2}))
    assert set(engine.stats()["slots_per_layer"].values()) == {8}  # unchanged
    for layer in engine.layers.values():
        check_cache_invariants(layer.loader)
    engine.close()


@pytest.mark.parametrize("cache", ["lru", "plec"])
def test_a_rebuild_frees_the_old_slots_before_it_allocates_new_ones(make_engine, cache):
    # The caches and their pool refer to each other: dropped as they are, their slot
    # tensors would live until the garbage collector's next pass, so a rebuild would
    # hold two pools at once (on a GPU, twice the budget). Collection is off here, so
    # only freeing them explicitly lets them go.
    import gc
    import weakref

    extra = {"path_predictor": "/rpp"} if cache == "plec" else {}
    engine, _ = make_engine(budget=0.25, cache=cache, **extra)
    old = [weakref.ref(layer.cache.slots["w13_weight"]) for layer in engine.layers.values()]
    gc.disable()
    try:
        engine.reconfigure(engine.config.changed({"budget": 0.5}))
        assert [ref() for ref in old] == [None] * len(old)
    finally:
        gc.enable()
    engine.close()


def test_a_deferred_engine_runs_no_expert_until_its_slots_are_made(toy_engines):
    # A lookahead draft's engine while its rows are lent to the target: no slot is made,
    # a call's routed output is zero (nothing read); once made, it runs exactly.
    layers = {name: random_layer(seed=i) for i, name in enumerate(NAMES)}
    engine = toy_engines({"budget": 0.25}, layers, top_k=4, slots_deferred=True)
    assert not any(layer.equipped for layer in engine.layers.values())
    assert "slots not made yet" in engine.summary()
    x, w, ids = random_routing(2, 16, 4, seed=1)
    call = LayerCall(NAMES[0], slot_kernel, x, w, ids, PassPhases.decode_only(2))
    assert torch.equal(engine.run_call(call), torch.zeros_like(x))
    assert engine.stats()["slots_per_layer"] == {} and engine.link.bytes_copied == 0
    engine.equip_deferred()
    assert set(engine.stats()["slots_per_layer"].values()) == {4}
    call = LayerCall(NAMES[0], slot_kernel, x, w, ids, PassPhases.decode_only(2))
    assert torch.equal(engine.run_call(call), reference_moe(x, w, ids, *layers[NAMES[0]].values()))


def test_adopting_a_plan_resizes_the_caches_and_keeps_features_and_counters(make_engine):
    # What the target does when its lookahead draft first drafts: the slots its draft's
    # rows were lent to are given back, mid-run; the governor (a feature) and the counters
    # of the run so far stay.
    from vllm_specexpert.budget_plan import SlotPlan

    engine, layers = make_engine(budget=0.5, predictor="router")
    features = list(engine.features)
    x, w, ids = random_routing(2, 16, 4, seed=2)
    engine.run_call(LayerCall(NAMES[0], slot_kernel, x, w, ids, PassPhases.decode_only(2)))
    calls = engine.stats()["layers"][NAMES[0]]["decode"]["calls"]
    engine.adopt(SlotPlan(0.25))
    assert set(engine.stats()["slots_per_layer"].values()) == {4}
    assert engine.features == features and all(
        a is b for a, b in zip(engine.features, features, strict=True)
    )
    assert engine.stats()["layers"][NAMES[0]]["decode"]["calls"] == calls == 1
    out = engine.run_call(LayerCall(NAMES[0], slot_kernel, x, w, ids, PassPhases.decode_only(2)))
    assert torch.equal(out, reference_moe(x, w, ids, *layers[NAMES[0]].values()))
    for layer in engine.layers.values():
        check_cache_invariants(layer.loader)


def test_restart_returns_to_the_warm_start(make_engine):
    """What the plugin does after vLLM's warm-up passes: whatever they loaded, serving
    starts from the warm-start experts (0-3 of 16 here) with every counter at zero."""
    engine, layers = make_engine(budget=0.25)
    name = NAMES[0]
    x, w, _ = random_routing(1, 16, 4)
    ids = torch.tensor([[8, 9, 10, 11]], dtype=torch.int32)
    engine.run_call(LayerCall(name, slot_kernel, x, w, ids, PassPhases.prefill_only(1)))
    assert np.flatnonzero(engine.layers[name].cache.resident_mask()).tolist() == [8, 9, 10, 11]
    engine.restart()
    for layer in engine.layers.values():
        assert np.flatnonzero(layer.cache.resident_mask()).tolist() == [0, 1, 2, 3]
        check_cache_invariants(layer.loader)
    assert engine.stats()["total"]["prefill"]["requests"] == 0
    out = engine.run_call(LayerCall(name, slot_kernel, x, w, ids, PassPhases.prefill_only(1)))
    assert torch.equal(out, reference_moe(x, w, ids, *layers[name].values()))
    assert engine.stats()["total"]["prefill"]["misses"] == 4  # loaded again
    engine.close()


class Writes:
    """Every stats write attempt (``stats_writers.write_json_atomic``): its thread, path and
    snapshot, and a way to wait for one that matches (a deadline only guards a hang)."""

    def __init__(self, monkeypatch):
        from vllm_specexpert import stats_writers

        self.seen: list[tuple[str, str, dict]] = []
        self.changed = threading.Condition()
        real = stats_writers.write_json_atomic

        def recording(path, payload):
            with self.changed:
                self.seen.append((threading.current_thread().name, str(path), payload))
                self.changed.notify_all()
            real(path, payload)

        monkeypatch.setattr(stats_writers, "write_json_atomic", recording)

    def wait_for(self, matches, since: int = 0) -> None:
        """Until a write from ``since`` on ``matches(thread, path, payload)``."""
        with self.changed:
            assert self.changed.wait_for(lambda: any(matches(*w) for w in self.seen[since:]), 60)


def test_stats_file_is_written_by_a_timer_not_by_the_forward_pass(
    make_engine, tmp_path, monkeypatch
):
    writes = Writes(monkeypatch)
    path = tmp_path / "stats-{rank}.json"
    engine, _ = make_engine(budget=0.5, stats_path=str(path), stats_interval_s=0.1)
    x, w, ids = random_routing(2, 16, 4)
    for _ in range(3):
        engine.run_call(LayerCall(NAMES[0], slot_kernel, x, w, ids))
    writes.wait_for(lambda thread, _, payload: payload["decode_tokens"] == 6)
    engine.close()  # (its last write is the close's, in this thread)
    during = writes.seen[: next(i for i, w in enumerate(writes.seen) if w[2]["decode_tokens"] == 6)]
    assert {thread for thread, _, _ in during} <= {"specexpert-stats"}
    payload = json.loads((tmp_path / "stats-0.json").read_text())
    assert payload["config"]["budget"] == 0.5 and set(payload["layers"]) == set(NAMES)


@pytest.mark.parametrize("where", ["under a regular file", "in /proc"])
def test_unwritable_stats_path_fails_at_start(make_engine, tmp_path, where):
    """D1: a stats_path that cannot be written is a config error when the engine starts,
    not a crash at the first periodic write."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = blocker / "stats.json" if where == "under a regular file" else "/proc/x/stats.json"
    with pytest.raises(SpecExpertConfigError, match=r"'stats_path'.*cannot write"):
        make_engine(budget=0.5, stats_path=str(path), stats_interval_s=0)


def test_stats_path_that_breaks_later_does_not_stop_the_engine(make_engine, tmp_path, monkeypatch):
    """Writable at start, then its directory is replaced by a file: writes fail, one
    warning is logged, and the engine keeps computing."""
    writes = Writes(monkeypatch)
    directory = tmp_path / "stats"
    engine, layers = make_engine(
        budget=0.5, stats_path=str(directory / "s.json"), stats_interval_s=0
    )
    engine.write_stats()
    assert json.loads((directory / "s.json").read_text())["rank"] == 0
    shutil.rmtree(directory)
    directory.write_text("")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm_specexpert.stats_writers")
    logger.addHandler(handler)
    try:
        engine.write_stats()
        broken = len(writes.seen)
        # the periodic writer fails too
        writes.wait_for(lambda thread, _, __: thread == "specexpert-stats", since=broken)
        engine.write_stats()
    finally:
        logger.removeHandler(handler)
    x, w, ids = random_routing(2, 16, 4)
    out = engine.run_call(LayerCall(NAMES[0], slot_kernel, x, w, ids))
    assert torch.equal(out, reference_moe(x, w, ids, *layers[NAMES[0]].values()))
    assert [r.getMessage().startswith("specexpert: cannot write stats_path") for r in records] == [
        True
    ]
    engine.close()


def test_exact_layers_that_are_not_moe_layers_fail_at_start(make_engine):
    """D4: ``exact_layers: [100]`` on a model with fewer layers was accepted silently."""
    with pytest.raises(SpecExpertConfigError, match=r"'exact_layers'.*\[100\] are not MoE"):
        make_engine(miss_policy="speculate", predictor="router", exact_layers=[1, 100])
    engine, _ = make_engine(miss_policy="speculate", predictor="router", exact_layers=[1])
    engine.close()


def test_phases_from_query_lens():
    # Requests of 1, 3, 1 and 2 tokens, then 2 padding rows.
    phases = PassPhases.from_query_lens(np.array([1, 3, 1, 2]), 9)
    assert phases.decode.tolist() == [0, 4]
    assert phases.prefill.tolist() == [1, 2, 3, 5, 6, 7, 8]
    assert PassPhases.from_query_lens(np.array([1, 1, 1]), 3).all_decode
    assert PassPhases.from_query_lens(np.array([4, 2]), 6).all_prefill
    # Padding after decode requests runs as prefill (exactly), not through the policy.
    padded = PassPhases.from_query_lens(np.array([1, 1]), 4)
    assert padded.decode.tolist() == [0, 1] and padded.prefill.tolist() == [2, 3]


@pytest.mark.parametrize("tokens", [1, 2])
def test_hits_refresh_lru_recency(make_engine, tokens):
    """A call whose experts are all resident still counts as their use: with 8 of 16
    resident (0-7, never used), using 0-3 and then loading 8-11 must evict 4-7, the
    least recently used. Batch 1 runs the single-token hit path, batch 2 the general one."""
    engine, layers = make_engine(budget=0.5)
    name = NAMES[0]
    x, w, _ = random_routing(tokens, 16, 4)
    hits = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]][:tokens], dtype=torch.int32)
    engine.run_call(LayerCall(name, slot_kernel, x, w, hits, PassPhases.decode_only(tokens)))
    misses = torch.tensor([[8, 9, 10, 11], [11, 10, 9, 8]][:tokens], dtype=torch.int32)
    out = engine.run_call(
        LayerCall(name, slot_kernel, x, w, misses, PassPhases.decode_only(tokens))
    )
    assert torch.equal(out, reference_moe(x, w, misses, *layers[name].values()))
    resident = np.flatnonzero(engine.layers[name].cache.resident_mask())
    assert resident.tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    decode = engine.stats()["layers"][name]["decode"]
    assert (decode["hits"], decode["misses"]) == (4, 4)
    engine.close()


def test_a_fully_resident_layer_runs_a_token_without_reading_its_ids(
    make_engine, host_reads, monkeypatch
):
    # Budget 1.0: every expert sits in the slot of its own id, so a single token needs
    # no host decision. Counted like the general path would (top-k distinct experts,
    # all hits), exact, and without a single host read of a tensor.
    engine, layers = make_engine(budget=1.0)
    reads = host_reads
    reads.clear()
    for step in range(3):
        x, w, ids = random_routing(1, 16, 4, seed=step)
        out = engine.run_call(
            LayerCall(NAMES[0], slot_kernel, x, w, ids, PassPhases.decode_only(1))
        )
        assert torch.equal(out, reference_moe(x, w, ids, *layers[NAMES[0]].values()))
    x, w, ids = random_routing(1, 16, 4, seed=7)
    engine.run_call(LayerCall(NAMES[0], slot_kernel, x, w, ids, PassPhases.prefill_only(1)))
    assert reads == []
    monkeypatch.undo()
    first = engine.stats()["layers"][NAMES[0]]
    assert (
        first["decode"]["calls"],
        first["decode"]["requests"],
        first["decode"]["hits"],
        first["decode"]["misses"],
    ) == (3, 12, 12, 0)
    assert (first["prefill"]["calls"], first["prefill"]["hits"]) == (1, 4)
    # An eviction ends the identity: experts 3 and 5 come back in each other's slots
    # (two-token batches take the general path), and a single token must then find 3
    # through the map, not in slot 3.
    layer = engine.layers[NAMES[0]]
    layer.loader.evict(np.array([3, 5]), layer.stats.decode)
    x, w, _ = random_routing(2, 16, 4, seed=8)
    for experts in ([5, 0, 1, 2], [3, 0, 1, 2]):
        ids = torch.tensor([experts, experts], dtype=torch.int32)
        engine.run_call(LayerCall(NAMES[0], slot_kernel, x, w, ids, PassPhases.decode_only(2)))
    assert engine.layers[NAMES[0]].cache.expert_slot[[3, 5]].tolist() == [5, 3]
    ids = torch.tensor([[3, 6, 7, 8]], dtype=torch.int32)
    out = engine.run_call(
        LayerCall(NAMES[0], slot_kernel, x[:1], w[:1], ids, PassPhases.decode_only(1))
    )
    assert torch.equal(out, reference_moe(x[:1], w[:1], ids, *layers[NAMES[0]].values()))
    engine.close()


def test_an_engine_a_test_leaves_open_is_closed_when_the_test_ends(tmp_path):
    """What conftest's ``toy_engines`` does for every test: the engine a test built and
    left open stops its threads when the test ends, passed or failed."""
    from toy_engine import closing_engines

    with pytest.raises(AssertionError, match="the test failed"), closing_engines() as build:
        engine = build(
            {"budget": 0.5, "stats_path": str(tmp_path / "s.json"), "stats_interval_s": 60},
            {name: random_layer(seed=i) for i, name in enumerate(NAMES)},
            top_k=4,
        )
        assert engine.link._thread.is_alive()  # the copy thread
        assert engine.reporter._stats_writer._thread.is_alive()  # the stats writer
        raise AssertionError("the test failed")
    assert not engine.link._thread.is_alive()
    assert not engine.reporter._stats_writer._thread.is_alive()
