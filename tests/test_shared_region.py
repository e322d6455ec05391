"""The shared region's memory (:mod:`vllm_specexpert.tiers.shared_region`): every layer's
slot tensor covers its own rows and then the same region rows; the own rows are each
layer's; the mappings go with the last tensor on them."""

import gc
import itertools
import re
import resource
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_specexpert.tiers.shared_region import PAGE, SharedRegion

SHAPES = {
    "w13_weight": ((64, 24), torch.bfloat16),  # 3 KiB a row: not a whole page
    "w2_weight": ((32, 64), torch.bfloat16),  # 4 KiB a row
}


def region_mappings() -> int:
    """This process's mappings of a region's memfd."""
    maps = Path("/proc/self/maps").read_text()
    return len(re.findall(r"memfd:specexpert-region-", maps))


def test_every_layer_sees_the_same_region_rows_after_its_own():
    region = SharedRegion(3, SHAPES)
    first, second = region.views(5), region.views(2)
    for name, (shape, dtype) in SHAPES.items():
        a, b = first[name], second[name]
        assert a.shape == (8, *shape) and b.shape == (5, *shape) and a.dtype == dtype
        assert a.is_contiguous() and b.is_contiguous()
        assert (a.data_ptr() + 5 * a[0].nbytes) % PAGE == 0  # (the region starts a page)
        assert torch.count_nonzero(a) == 0 and torch.count_nonzero(b) == 0
        a[5 + 1] = 1.5  # a region row written through one layer's tensor ...
        assert torch.equal(b[2 + 1], a[5 + 1])  # ... is the other's
        b[0] = 2.0  # an own row is its layer's alone
        assert torch.count_nonzero(a[:5]) == 0
        assert torch.count_nonzero(b[1:2]) == 0
    region.close()


def test_the_mappings_go_with_the_last_tensor_on_them():
    before = region_mappings()
    region = SharedRegion(2, SHAPES)
    views = region.views(4)
    region.close()  # (the files may close first: the mappings hold the memory)
    assert region_mappings() == before + len(SHAPES)
    views["w2_weight"][4:] = 3.0  # still there
    row = views["w2_weight"][5].clone()
    del views
    gc.collect()
    assert region_mappings() == before
    assert torch.all(row == 3.0)


def test_every_layer_maps_the_region_populated():
    # Each layer's tensor maps the same memfd pages; a page first touched through a
    # mapping faults there, once per layer: on the miniature a million faults over the
    # first minutes, a fifth off every read (a disk read writes its rows: no fault-around
    # there). The views come populated: writing a byte of every page of another layer's
    # view, after the first wrote the region, faults at none of them.
    shapes = {"w": ((64, 2048), torch.bfloat16)}  # 256 KiB rows
    region = SharedRegion(8, shapes)
    first, second = region.views(2)["w"], region.views(2)["w"]
    first[2:] = 1.0
    pages = second[2:].nbytes // PAGE
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    second[2:].view(-1).view(torch.uint8)[::PAGE] = 7  # one byte a page
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert bool((first[2:].view(-1).view(torch.uint8)[::PAGE] == 7).all())
    assert faults < pages // 4, (faults, pages)
    region.close()


def test_a_region_needs_a_row():
    with pytest.raises(ValueError, match="at least one row"):
        SharedRegion(0, SHAPES)


# ------------------------------------------------------------- under the engine

from moe_reference import random_layer, random_routing, reference_moe, slot_kernel  # noqa: E402

from vllm_specexpert import engine as engine_module  # noqa: E402
from vllm_specexpert.config import SpecExpertConfig  # noqa: E402
from vllm_specexpert.config.sizing import region_split  # noqa: E402
from vllm_specexpert.engine import OffloadEngine  # noqa: E402
from vllm_specexpert.layer_call import LayerCall  # noqa: E402
from vllm_specexpert.phases import PassPhases  # noqa: E402
from vllm_specexpert.read_ahead import (  # noqa: E402
    PROBE_EXPERTS,
    LaunchProbe,
    probe_launch,
    reserved_rows,
)
from vllm_specexpert.tiers.disk import Disk  # noqa: E402
from vllm_specexpert.tiers.expert_pack import ExpertPack  # noqa: E402
from vllm_specexpert.tiers.kernel_form import KernelForm  # noqa: E402
from vllm_specexpert.tiers.pack_writer import write_pack  # noqa: E402
from vllm_specexpert.tiers.slots import NO_EXPERTS  # noqa: E402

NAMES = [f"model.layers.{i}.mlp.experts" for i in range(4)]
LAYERS = {name: random_layer(seed=i) for i, name in enumerate(NAMES)}
"""Each layer's experts other (other seeds): a launch on another layer's row differs."""
E, K = 16, 4
SWEEP = 32
"""Tokens whose routing needs every expert of a layer (checked)."""


@pytest.mark.parametrize(
    ("slots", "layers", "need", "ahead", "own", "rows"),
    [
        (34, 8, 512, 0, 29, 40),  # the miniature: (8*34 - 64) / 7 = 29.7
        (34, 8, 512, 8, 28, 48),  # 8 rows ahead: (8*34 - 64 - 8) / 7 = 28.6
        (16, 8, 1024, 0, 9, 56),
        (16, 8, 32, 0, 12, 32),  # calls of at most 32 experts: the region holds 32
        (16, 8, 32, 4, 11, 40),  # and 4 ahead: (8*16 - 32 - 4) / 8 = 11.5
        (16, 8, 4, 0, 16, 0),  # batch 1: the own slots hold a call's experts
        (4, 8, 256, 0, 4, 0),  # top_k a layer leaves nothing to share
        (16, 1, 999, 0, 16, 0),  # one layer: nothing to share with
    ],
)
def test_the_budget_splits_into_own_slots_and_one_region(slots, layers, need, ahead, own, rows):
    split = region_split(slots, layers, 64, 4, need, ahead)
    assert (split.own, split.rows) == (own, rows)
    if rows:  # the same memory, and a call needing min(need, 64) misses at most `rows`,
        assert layers * split.own + split.rows <= layers * slots  # with `ahead` to spare
        assert min(need, 64 - split.own) + ahead <= split.rows


@pytest.mark.parametrize(
    ("setting", "seqs", "measured", "rows"),
    [
        ("auto", 256, 16.0, 16),
        ("auto", 256, 6.2, 7),  # rounded up
        ("auto", 256, 99.0, 64),  # never more than a layer's experts
        ("auto", 256, None, 0),  # nothing measured (no probe could run): none
        (5, 256, 99.0, 5),
        ("auto", 8, 16.0, 0),  # 32 experts of 64 at most: no sweep, nothing is read ahead
        (5, 8, None, 0),
    ],
)
def test_the_rows_kept_for_reads_ahead(setting, seqs, measured, rows):
    assert reserved_rows(setting, seqs, 4, 64, lambda: measured) == rows


@pytest.fixture(scope="module")
def pack(tmp_path_factory) -> ExpertPack:
    out = tmp_path_factory.mktemp("region") / "pack"
    write_pack(
        out,
        [(name, E) for name in NAMES],
        lambda name, e: {k: t[e] for k, t in LAYERS[name].items()},
        {"model": "toy", "checkpoint_files": []},
        KernelForm(layout="checkpoint", dtype="bfloat16"),
    )
    return ExpertPack(out)


@pytest.fixture
def engine_on(pack):
    """``engine_on(config, max_num_seqs, read_ahead_rows)``: an engine reading
    :data:`LAYERS` from the pack on disk (the slots residency), with vLLM's
    ``max_num_seqs``, keeping no rows for reads ahead unless told; closed after."""
    made = []

    def make(
        config: dict, max_num_seqs: int = SWEEP, read_ahead_rows: int | str = 0
    ) -> OffloadEngine:
        disk = {"path": str(pack.path), "read_ahead_rows": read_ahead_rows}
        engine = OffloadEngine(
            SpecExpertConfig.from_dict({"quality": None, "disk": disk, **config}),
            torch.device("cpu"),
        )
        made.append(engine)
        engine.budget.sizing.moe_layers = len(NAMES)
        engine.budget.sizing.max_num_seqs = max_num_seqs
        engine.store.tiers.append(Disk(pack, depth=2))
        for index, name in enumerate(NAMES):
            engine.add_layer(name, engine.store.tier("disk").layer(name), top_k=K, index=index)
        engine.start()
        return engine

    yield make
    for engine in made:
        engine.close()


def sweep_routing(seed: int):
    x, w, ids = random_routing(SWEEP, E, K, seed=seed)
    assert len(np.unique(ids.numpy())) == E
    return x, w, ids


def call(engine, name, x, w, ids):
    return engine.run_call(
        LayerCall(name, slot_kernel, x, w, ids, PassPhases.decode_only(x.shape[0]))
    )


def counted(engine, name) -> dict:
    decode = engine.stats()["layers"][name]["decode"]
    keys = ("loads", "region_loads", "evictions", "kernel_calls", "hits")
    return {k: decode[k] for k in keys}


def test_a_call_needing_every_expert_reads_each_missing_one_once_in_one_launch(engine_on):
    # Issue 74 (1): at budget 0.5 of 4 layers, each layer keeps (4*8 - 16) / 3 = 5 own
    # slots and the region the other 12 rows; a call needing all 16 reads its 11 missing
    # experts once into the region's rows, keeps its own 5, and runs in one launch, equal
    # to the reference kernel on every expert (one sum per token: exact). A row goes
    # first from the layer whose next call comes last (the one that ran just before):
    # in step 0 each layer takes the rows of the one before it, so the first layer's
    # twelfth row stays; in step 1 the first layer finds that expert there (6 hits, 10
    # reads), and the last finds the one of its rows the first layer did not need.
    engine = engine_on({"budget": 0.5})
    assert [la.cache.num_slots for la in engine.layers.values()] == [5] * 4
    assert [la.cache.pool.region_rows for la in engine.layers.values()] == [12] * 4
    assert "one region of 12 rows" in engine.summary()
    x, w, ids = sweep_routing(0)
    disk = engine.store.tier("disk")
    hits = {(0, 0): 5, (0, 1): 5, (0, 2): 5, (0, 3): 5, (1, 0): 6, (1, 1): 5, (1, 2): 5}
    hits[1, 3] = 6
    for step in range(2):
        for index, name in enumerate(NAMES):
            before, reads, nbytes = counted(engine, name), disk.stats.reads, disk.stats.bytes
            out = call(engine, name, x, w, ids)
            assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values()))
            after = counted(engine, name)
            delta = {k: after[k] - before[k] for k in after}
            missing = 16 - hits[step, index]
            free = 12 if (step, index) == (0, 0) else 1 if (step, index) == (0, 1) else 0
            expected = {
                "loads": missing,
                "region_loads": missing,
                "evictions": missing - min(free, missing),
                "kernel_calls": 1,
                "hits": hits[step, index],
            }
            assert delta == expected, (step, name, delta)
            assert disk.stats.reads - reads == missing  # each missing expert read once
            assert disk.stats.bytes - nbytes == missing * engine.layers[name].experts.expert_nbytes
            cache = engine.layers[name].cache
            assert cache.num_resident() == 16 and cache.expert_slot[:].max() < 5 + 12
    held = [la.cache.num_resident() for la in engine.layers.values()]
    assert sum(held) == 4 * 5 + 12  # every row of the memory holds an expert


def test_small_calls_take_free_rows_then_the_longest_unused_across_layers(engine_on):
    # A call whose experts fit: its misses take the region's free rows before evicting
    # its own experts; once the rows are full, whatever has gone unused longest, counted
    # from its layer's last call: here the last layer's own warm-start experts, never used,
    # rather than the rows the layers before it just loaded. So the budget's whole
    # memory caches experts at a batch of one too.
    engine = engine_on({"budget": 0.5})
    rows = engine.layers[NAMES[0]].cache.pool.rows
    ids = torch.tensor([[12, 13, 14, 15]], dtype=torch.int32)  # (none held: own hold 0-4)
    x, w, _ = random_routing(1, E, K, seed=4)
    for name in NAMES:
        out = call(engine, name, x, w, ids)
        assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values()))
        if name == NAMES[2]:  # the three layers' misses filled the 12 free rows
            assert [NAMES.index(h.experts.name) for h in rows.holder] == [0] * 4 + [1] * 4 + [2] * 4
    assert [NAMES.index(h.experts.name) for h in rows.holder] == [0] * 4 + [1] * 4 + [2] * 4
    for name in NAMES[:3]:
        own = engine.layers[name].cache.slot_expert[:5]
        assert sorted(own.tolist()) == [0, 1, 2, 3, 4]  # nothing of theirs evicted
    last = engine.layers[NAMES[3]].cache
    assert sorted(last.slot_expert[:5].tolist()) == [4, 12, 13, 14, 15]


def test_the_running_layer_counts_its_own_idle_from_this_call(engine_on):
    # A layer's experts not needed by the call running now were skipped by it: the call
    # counts, as another layer's last call counts for that layer's rows. Step a: layers
    # 1-3 fill the 12 rows with 12-15, layer 0 uses 0-3 (own); step b: every layer uses
    # 1-4 (own), so each row has been skipped once, at its layer's last call. Step c:
    # layer 0 needs 0, 1, 2 and 5; its 3 and 4 were used at b and skipped now, once as
    # well: a tie, and the running layer's next call is the furthest, so it evicts its
    # own. Counting its idle from its previous call instead makes its 3 and 4 look
    # unused for no call and takes a row that the layer running next may need.
    engine = engine_on({"budget": 0.5})
    rows = engine.layers[NAMES[0]].cache.pool.rows
    x, w, _ = random_routing(1, E, K, seed=4)
    steps = [
        {0: [0, 1, 2, 3], 1: [12, 13, 14, 15], 2: [12, 13, 14, 15], 3: [12, 13, 14, 15]},
        {i: [1, 2, 3, 4] for i in range(4)},
    ]
    for step in steps:
        for index, name in enumerate(NAMES):
            ids = torch.tensor([step[index]], dtype=torch.int32)
            out = call(engine, name, x, w, ids)
            assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values()))
    held = [NAMES.index(h.experts.name) for h in rows.holder]
    assert held == [1] * 4 + [2] * 4 + [3] * 4
    ids = torch.tensor([[0, 1, 2, 5]], dtype=torch.int32)
    out = call(engine, NAMES[0], x, w, ids)
    assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[NAMES[0]].values()))
    assert [NAMES.index(h.experts.name) for h in rows.holder] == held  # no row taken
    own = engine.layers[NAMES[0]].cache.slot_expert[:5].tolist()
    assert 5 in own and len({3, 4} & set(own)) == 1, own


def test_a_call_past_its_own_slots_leaves_them_its_most_used_experts(engine_on):
    # The rows full (layers 1-3 swept), layer 0 calls 32 tokens on experts 5-15, 13-15
    # on every token, 5-12 on 4 each: its 11 misses evict its own 0-4 (never used) and 6
    # rows. Its own slots take 13, 14 and 15, the rows the rest: the next layers take the
    # rows first, so what it used most stays. In file order its own slots took 5-9, and
    # the next layers' sweeps left it none of 13-15.
    engine = engine_on({"budget": 0.5})
    for name in NAMES[1:]:
        call(engine, name, *sweep_routing(7))
    x, w, _ = random_routing(SWEEP, E, K, seed=8)
    ids = torch.tensor([[13, 14, 15, 5 + t % 8] for t in range(SWEEP)], dtype=torch.int32)
    out = call(engine, NAMES[0], x, w, ids)
    assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[NAMES[0]].values()))
    cache = engine.layers[NAMES[0]].cache
    assert {13, 14, 15} <= set(cache.slot_expert[: cache.num_slots].tolist())
    for name in NAMES[1:]:
        call(engine, name, *sweep_routing(9))
    assert all(cache.expert_slot[e] >= 0 for e in (13, 14, 15))


@pytest.mark.parametrize(("cache", "first_out"), [("lru", {0, 1, 2, 3}), ("lrfu", {4, 5, 6, 7})])
def test_a_demand_load_evicts_the_layers_own_experts_in_its_cache_policys_order(
    engine_on, cache, first_out
):
    # Layer 0 uses 0-3 in four calls, then 4-7 once (5-7 into rows). Its demand load then
    # evicts, after the 9 free rows, the least recent (LRU: 0-3) or the least used by
    # decayed count (lrfu: 4-7, one use against four). Ordering the own experts by
    # recency alone, whatever the cache, made every cache LRU wherever a region is (the
    # disk tier's default), in a benchmark: the same bytes, to the byte.
    engine = engine_on({"budget": 0.5, "cache": cache})
    x, w, _ = random_routing(1, E, K, seed=4)
    for ids in [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]]:
        call(engine, NAMES[0], x, w, torch.tensor([ids], dtype=torch.int32))
    layer = engine.layers[NAMES[0]].cache
    assert layer.num_resident() == 8 and layer.pool.region_rows == 12  # 9 rows still free
    slots, evicted = layer.pool.take(layer, 9 + 4, NO_EXPERTS, shared=True)
    assert len(slots) == 13 and set(evicted.tolist()) == first_out


def test_layers_back_to_back_through_the_region_each_compute_with_their_own_experts(engine_on):
    # The region is every layer's: a layer's call fills it with its own missing experts
    # after the call before it ran. A launch that computed with another layer's expert
    # left in a row would differ from the reference. Two other routings, layers in turn.
    engine = engine_on({"budget": 0.5})
    for seed in (1, 2):
        x, w, ids = sweep_routing(seed)
        for name in NAMES:
            out = call(engine, name, x, w, ids)
            assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values())), name


def test_where_it_cannot_pay_there_is_no_region(engine_on, toy_engines):
    # No max_num_seqs (an engine without vLLM's settings), a batch the own slots hold, a
    # policy that does not load its misses, and experts in RAM: the own slots only.
    for config, seqs in (
        ({"budget": 0.5}, 0),
        ({"budget": 0.5}, 2),
        ({"budget": 0.5, "miss_policy": "drop"}, SWEEP),
    ):
        engine = engine_on(config, seqs)
        assert [la.cache.num_slots for la in engine.layers.values()] == [8] * 4, (config, seqs)
        assert all(la.cache.pool.region_rows == 0 for la in engine.layers.values())
    in_ram = toy_engines({"budget": 0.5}, LAYERS, K, max_num_seqs=SWEEP)
    assert [la.cache.num_slots for la in in_ram.layers.values()] == [8] * 4


def test_a_reconfigure_makes_the_region_again_for_the_new_budget(engine_on):
    engine = engine_on({"budget": 0.5})
    engine.reconfigure(engine.config.changed({"budget": 0.75}))  # (4*12 - 16) / 3 = 10
    assert [la.cache.num_slots for la in engine.layers.values()] == [10] * 4
    assert [la.cache.pool.region_rows for la in engine.layers.values()] == [8] * 4
    x, w, ids = sweep_routing(3)
    name = NAMES[2]
    assert torch.equal(
        call(engine, name, x, w, ids), reference_moe(x, w, ids, *LAYERS[name].values())
    )
    # The rows kept for reads ahead change at run time too: (4*12 - 16 - 3) // 3 = 9.
    SpecExpertConfig.check_changes({"disk": {"read_ahead_rows": 3}})  # (as sent: the path kept)
    engine.reconfigure(engine.config.changed({"disk": {"read_ahead_rows": 3}}))
    assert [la.cache.num_slots for la in engine.layers.values()] == [9] * 4
    assert engine.stats()["read_ahead_rows"]["kept"] == 3 + 2  # (and 2 by rounding: 48 - 4*9)
    assert torch.equal(
        call(engine, name, x, w, ids), reference_moe(x, w, ids, *LAYERS[name].values())
    )


def test_a_prefetch_never_loads_into_a_row_another_layer_may_take(engine_on):
    # A prefetch is not waited for in its call: in a row another layer's call takes it
    # would land on that layer's expert. So it takes own slots only, never a row, even
    # where the layer's least recently used expert sits in a row (found by the disk
    # tests: a prefetch reused a row, the next layer's call found it in flight).
    engine = engine_on({"budget": 0.5})
    first, second = (engine.layers[n] for n in NAMES[:2])
    x, w, ids = sweep_routing(0)
    call(engine, first.name, x, w, ids)  # (its 11 misses in the rows)
    cache = first.cache
    own = cache.slot_expert[: cache.num_slots].copy()
    small = torch.from_numpy(own[:4].astype(np.int32))[None]
    call(engine, first.name, *random_routing(1, E, K, seed=9)[:2], small)  # own: used last
    in_rows = np.flatnonzero(cache.expert_slot >= cache.num_slots)
    wanted = in_rows[:3]
    cache.release(wanted)  # (not resident: the prefetch loads them; the rows' others
    stats = first.stats.decode  # are now the least recently used of the layer)
    assert first.loader.prefetch(wanted, stats) == 3
    assert np.all(cache.expert_slot[wanted] < cache.num_slots)
    out = call(engine, second.name, x, w, ids)  # takes the rows: none is in flight
    assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[second.name].values()))


def test_the_next_layers_reads_run_beside_a_launch_and_never_into_its_rows(engine_on):
    # Issue 74 (2): before a layer's launch, the following layer's last demand is read
    # ahead into rows the launch does not use. The kernel here waits for every read in
    # flight to land before it computes, so a read ahead into a row of the running
    # launch would be in that launch's weights: its output would differ from the
    # reference. Calls of 4 tokens needing 12 or 13 of the 16 experts (the share that
    # is read ahead, 3/4), more than the 5 own slots, leave rows spare; the same routing
    # each step, so every read ahead is used. Then sweeps: a launch holds 11 of the 12
    # rows, one is spare for the reads ahead. Then calls of one token: too few experts
    # for a guess to pay, nothing is read ahead.
    engine = engine_on({"budget": 0.5})
    for name, next_name in itertools.pairwise(NAMES):
        engine.link_layers(name, next_name)

    running: list[str] = []
    blocked: list[bool] = []

    def waiting_kernel(*args, **kwargs):
        # What the running layer counts it could still load (its capacity beyond its
        # experts) is what a demand load could take: never a row being read ahead for
        # the next layer (a token group planned on it could not be loaded).
        cache = engine.layers[running[-1]].cache
        resident = np.flatnonzero(cache.resident_mask())
        room = cache.pool.room(cache, resident)
        assert cache.capacity() - len(resident) == room
        reads = [t for la in engine.layers.values() for t in la.loader.reads_ahead.values()]
        blocked.append(bool(reads))  # (rows held for the next layer, not yet waited for)
        for transfer in reads:
            transfer.done.wait()  # (the CPU link's: landed, whoever copied it)
        return slot_kernel(*args, **kwargs)

    def step(routings):
        for name in NAMES:
            running.append(name)
            x, w, ids = routings[name]
            phases = PassPhases.decode_only(x.shape[0])
            out = engine.run_call(LayerCall(name, waiting_kernel, x, w, ids, phases))
            assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values())), name

    def read_ahead() -> tuple[int, int]:
        decode = [engine.stats()["layers"][n]["decode"] for n in NAMES]
        return sum(d["read_ahead"] for d in decode), sum(d["read_ahead_unused"] for d in decode)

    seeds = (21, 33, 43, 54)  # (4 tokens needing 12, 13, 13, 12 experts)
    most = {
        name: random_routing(4, E, K, seed=seed) for name, seed in zip(NAMES, seeds, strict=True)
    }
    for _ in range(3):
        step(most)
    read, unused = read_ahead()
    assert read > 0 and unused == 0 and any(blocked)
    sweeps = {name: sweep_routing(30 + i) for i, name in enumerate(NAMES)}
    for _ in range(2):
        step(sweeps)
    read_after_sweeps = read_ahead()[0]
    assert read_after_sweeps > read
    one = {name: random_routing(1, E, K, seed=40 + i) for i, name in enumerate(NAMES)}
    for _ in range(2):
        step(one)
    assert read_ahead()[0] == read_after_sweeps


def test_rows_kept_ahead_read_the_next_layers_missing_experts_beside_each_launch(engine_on):
    # Issue 74 (2): at budget 0.5 with 3 rows asked for reads ahead, each layer keeps
    # (4*8 - 16 - 3) // 3 = 4 own slots and the region 16 rows, 4 more than a sweep
    # misses. In a step of sweeps, once a layer's experts have landed, the following
    # layer's 4 first missing experts are read into the spare rows while its launch
    # computes (the kernel here sees them in flight), so that layer reads 8 on demand;
    # the first layer, after none, reads its 12. Each missing expert is read once, every
    # read ahead is used, and a launch reads only its own layer's experts. Without rows
    # kept (0: one spare, by rounding) one is read ahead a call.
    for asked, own, ahead in ((3, 4, 4), (0, 5, 1)):
        engine = engine_on({"budget": 0.5}, read_ahead_rows=asked)
        for name, next_name in itertools.pairwise(NAMES):
            engine.link_layers(name, next_name)
        assert [la.cache.num_slots for la in engine.layers.values()] == [own] * 4
        assert engine.layers[NAMES[0]].cache.pool.region_rows == E - own + ahead
        assert f"{ahead} more than a call needing every expert misses" in engine.summary()
        in_flight_at_launch: list[int] = []

        def seeing_kernel(*args, engine=engine, seen=in_flight_at_launch, **kwargs):
            seen.append(sum(len(la.loader.reads_ahead) for la in engine.layers.values()))
            for layer in engine.layers.values():
                for transfer in list(layer.loader.reads_ahead.values()):
                    transfer.done.wait()  # (landed: a read into this launch's rows shows)
            return slot_kernel(*args, **kwargs)

        disk = engine.store.tier("disk")
        routings = [sweep_routing(50 + i) for i in range(len(NAMES))]
        for step in range(4):
            in_flight_at_launch.clear()
            reads, before = disk.stats.reads, [counted(engine, n) for n in NAMES]
            for name, (x, w, ids) in zip(NAMES, routings, strict=True):
                phases = PassPhases.decode_only(x.shape[0])
                out = engine.run_call(LayerCall(name, seeing_kernel, x, w, ids, phases))
                assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values())), name
            if step == 0:  # (no following layer has a last demand yet)
                continue
            assert in_flight_at_launch == [ahead] * 3 + [0], asked
            if step == 1:  # (the rows still hold what the warm start left)
                continue
            after = [counted(engine, n) for n in NAMES]
            loads = [a["loads"] - b["loads"] for a, b in zip(after, before, strict=True)]
            assert loads == [E - own] * 4, (asked, loads)  # (a read ahead counts in its layer)
            assert disk.stats.reads - reads == 4 * (E - own)  # each missing one once
        decode = [engine.stats()["layers"][n]["decode"] for n in NAMES]
        assert [d["read_ahead"] for d in decode] == [0] + [3 * ahead] * 3, asked
        assert sum(d["read_ahead_unused"] for d in decode) == 0
        rows = engine.stats()["read_ahead_rows"]
        assert rows["kept"] == ahead and rows["hidden"] > 0  # (measured: its value varies)


class ThreadClock:
    """Seconds that pass by :meth:`advance`, each thread's own: a read timed in its
    thread and launches timed in another do not see each other's seconds."""

    def __init__(self) -> None:
        self.local = threading.local()

    def __call__(self) -> float:
        return getattr(self.local, "time", 0.0)

    def advance(self, seconds: float) -> None:
        self.local.time = self() + seconds


@pytest.mark.parametrize(
    ("kernel_beside_s", "read_beside_s", "rows"),
    [
        # The kernel on 4 experts' shares takes 3 ms, their read 1 ms. A launch on all 16
        # then computes 12 ms; beside reads untouched, it hides 16 * 3 / 1 = 48 reads.
        (0.003, 0.001, 48.0),
        # Reads beside it at half the speed: 24 reads; the kernel stretched by a third:
        # 16 ms hide 32 reads of 0.5 ms beside it (32 * 0.25 ms alone * 6/7 saved against 4).
        (0.003, 0.002, 24.0),
        (0.004, 0.002, 32.0),
        # Stretched as much as the reads it hides take alone (a kernel that fills the
        # cores, the reads' checksums taking them): no row pays.
        (0.006, 0.004, 0.0),
    ],
)
def test_the_rows_a_probed_launch_is_worth(kernel_beside_s, read_beside_s, rows):
    probe = LaunchProbe(4, 0.001, read_beside_s, 0.003, kernel_beside_s)
    assert probe.rows(16, 8) == pytest.approx(rows)
    assert LaunchProbe(4, 0.001, 0.001, 0.003, 0.003).rows(16, 2) == 0.0  # (a row: an own slot)


def test_auto_keeps_the_reads_a_probed_launch_hides(engine_on, monkeypatch):
    # disk.read_ahead_rows "auto": PROBE_EXPERTS experts read from the pack into scratch
    # rows, then the kernel on each one's share of a launch of max_num_seqs tokens
    # (32 * 4 / 16 = 8 tokens each), both timed alone (here by a clock the test moves: a
    # read of the 4 takes 1 ms, a launch on them 3 ms, each the best of two), then at
    # once: the reads in a thread while the kernel runs here, timed each.
    engine = engine_on({"budget": 0.5}, read_ahead_rows=0)
    layer = engine.layers[NAMES[1]]
    clock = ThreadClock()
    launches, beside = [], threading.Event()

    class TimedSource:  # (the pack's layer, its reads taking 1 ms, then 2 ms)
        def __init__(self, source):
            self.source, self.num_experts, self.slot_shapes = (
                source,
                source.num_experts,
                source.slot_shapes,
            )

        def copy_into(self, experts, slots, destinations):
            self.source.copy_into(experts, slots, destinations)
            if len(launches) < 2:
                clock.advance(0.001 * (1 + len(launches)))
                return
            beside.wait()  # (the third read: beside launches, until two ran)
            clock.advance(0.004)

    def kernel(x, weights, ids, tensors):
        launches.append((x.shape, ids[:, 0].tolist(), {k: t.clone() for k, t in tensors.items()}))
        clock.advance(0.003 if len(launches) <= 2 else 0.005)
        if len(launches) == 4:
            beside.set()
        return torch.zeros_like(x)

    probed = SimpleNamespace(host_kernel=kernel, experts=TimedSource(layer.experts), top_k=K)
    probe = probe_launch(probed, SWEEP, 64, clock)
    assert (probe.count, probe.read_s, probe.kernel_s) == (PROBE_EXPERTS, 0.001, 0.003)
    assert probe.kernel_beside_s == pytest.approx(0.005) and probe.read_beside_s == 0.004
    assert len(launches) >= 4  # (launches beside the reads until they end)
    shape, ids, read = launches[0]
    assert shape == (PROBE_EXPERTS * 8, 64) and sorted(ids) == sorted(list(range(4)) * 8)
    for name, tensor in read.items():  # the experts the pack holds, read into the rows
        assert torch.equal(tensor, LAYERS[NAMES[1]][name][:PROBE_EXPERTS]), name
    assert probe_launch(SimpleNamespace(host_kernel=None, experts=None), SWEEP, 64) is None
    assert probe_launch(probed, SWEEP, 0) is None  # (no hidden size: not under vLLM)

    class Unreadable(TimedSource):  # (a checksum failing: the probe keeps nothing)
        def copy_into(self, experts, slots, destinations):
            raise OSError("bad record")

    assert (
        probe_launch(
            SimpleNamespace(**{**vars(probed), "experts": Unreadable(layer.experts)}),
            SWEEP,
            64,
            clock,
        )
        is None
    )
    # The engine keeps what the probe found worth it (probed once, for every layer and
    # rebuild): 5.2 rows -> 6.
    probes = []

    class Worth(LaunchProbe):
        def rows(self, num_experts: int, layers: int) -> float:
            return 5.2

    worth = Worth(PROBE_EXPERTS, 0.001, 0.001, 0.003, 0.003)
    monkeypatch.setattr(engine_module, "probe_launch", lambda *a: probes.append(a) or worth)
    auto = engine_on({"budget": 0.5}, read_ahead_rows="auto")  # (32 - 16 - 6) // 3 = 3
    assert [la.cache.num_slots for la in auto.layers.values()] == [4] * 4  # (top_k at least)
    assert len(probes) == 1 and auto.stats()["read_ahead_rows"]["probe"]["kernel_s"] == 0.003
    auto.reconfigure(auto.config.changed({"budget": 0.75}))  # (48 - 16 - 6) // 3 = 8
    assert [la.cache.num_slots for la in auto.layers.values()] == [8] * 4 and len(probes) == 1


def test_a_budget_too_small_for_a_sweep_says_token_groups_and_stays_exact(engine_on):
    # Budget 6 of 16: (4*6 - 16) / 3 = 2 own slots is below top_k, so a layer keeps 4
    # and the region gets 8 rows: 12 experts at once, fewer than a sweep's 16. The start
    # line says a call needing more runs in token groups; such a call stays exact.
    engine = engine_on({"budget": 6})
    assert [la.cache.num_slots for la in engine.layers.values()] == [4] * 4
    assert [la.cache.pool.region_rows for la in engine.layers.values()] == [8] * 4
    assert "a call needing more than 12 experts runs in token groups" in engine.summary()
    x, w, ids = sweep_routing(5)
    name = NAMES[1]
    assert torch.equal(
        call(engine, name, x, w, ids), reference_moe(x, w, ids, *LAYERS[name].values())
    )
    assert counted(engine, name)["kernel_calls"] > 1
    roomy = engine_on({"budget": 0.5})
    assert "token groups" not in roomy.summary()


def test_layers_in_token_groups_back_to_back_read_nothing_ahead_into_their_rows(engine_on):
    # Budget 6 of 16 (4 own slots, 8 rows: token groups for a sweep), the layers linked,
    # sweeps on every layer: from the second pass each layer's last call needed every
    # expert, so the running layer's first group would read the next layer's ahead into
    # rows its own later groups need (found in `vllm bench throughput` at 256 sequences:
    # "cannot free 14 slots", a dead engine). A call in token groups reads nothing
    # ahead, and every layer stays exact.
    engine = engine_on({"budget": 6}, read_ahead_rows="auto")
    for name, next_name in itertools.pairwise(NAMES):
        engine.link_layers(name, next_name)
    sweeps = {name: sweep_routing(20 + i) for i, name in enumerate(NAMES)}
    for _ in range(3):
        for name in NAMES:
            x, w, ids = sweeps[name]
            out = call(engine, name, x, w, ids)
            assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values())), name
    decode = [engine.stats()["layers"][n]["decode"] for n in NAMES]
    assert all(d["kernel_calls"] > 3 for d in decode)  # (token groups, every call)
    assert sum(d["read_ahead"] for d in decode) == 0


def test_a_rebuild_counts_the_region_among_the_memory_it_frees(engine_on):
    # ``budget: auto`` at a reconfigure is sized from the free memory plus what the old
    # slots free; the region's rows are freed too. Left out (found in the miniature
    # benchmark: 3.2 GiB free at start, 2.6 at the next reconfigure), every rebuild would
    # shrink the budget by the region. Split or not, the slots are the budget's 4 x 8.
    engine = engine_on({"budget": 0.5})
    nbytes = engine.layers[NAMES[0]].experts.slot_nbytes
    assert engine.slot_bytes_held() == 4 * 8 * nbytes
