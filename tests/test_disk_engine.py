"""The disk tier under the engine, without vLLM: toy layers written to a pack, read back
by the link's copies (demand and prefetch), exact against the reference; counters in the
stats and on ``/metrics``; a failing read fails the rows that needed it (the call runs
without its experts, every other row exact), never runs what it left in a slot."""

import os

import numpy as np
import pytest
import torch
from moe_reference import random_layer, random_routing, reference_moe, slot_kernel
from test_metrics import scrape

from vllm_specexpert import metrics
from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.layer_call import LayerRequest
from vllm_specexpert.phases import PassPhases
from vllm_specexpert.tiers.disk import Disk
from vllm_specexpert.tiers.expert_pack import RECORDS_FILE, ExpertPack
from vllm_specexpert.tiers.pack_writer import write_pack

NAMES = [f"model.layers.{i}.mlp.experts" for i in range(2)]
LAYERS = {name: random_layer(seed=i) for i, name in enumerate(NAMES)}


@pytest.fixture
def pack(tmp_path) -> ExpertPack:
    write_pack(
        tmp_path / "pack",
        [(name, 16) for name in NAMES],
        lambda name, e: {k: t[e] for k, t in LAYERS[name].items()},
        {"model": "toy", "checkpoint_files": []},
    )
    return ExpertPack(tmp_path / "pack")


@pytest.fixture
def engine(pack, tmp_path, monkeypatch):
    (tmp_path / "metrics").mkdir()
    monkeypatch.setenv(metrics.DIRECTORY_ENV, str(tmp_path / "metrics"))
    monkeypatch.setenv(metrics.MODEL_NAME_ENV, "tiny")
    engine = OffloadEngine(SpecExpertConfig.from_dict({"budget": 0.25}), torch.device("cpu"))
    engine.store.disk = Disk(pack, depth=2)
    for index, name in enumerate(NAMES):
        engine.add_layer(name, engine.store.disk.layer(name, None), top_k=4, index=index)
    engine.start()
    yield engine
    engine.close()


def test_every_load_is_a_read_and_the_output_is_exact(engine, tmp_path):
    for step in range(4):
        for name in NAMES:
            x, w, ids = random_routing(3, 16, 4, seed=step)
            out = engine.run_call(
                LayerRequest(name, slot_kernel, x, w, ids, PassPhases.decode_only(3))
            )
            assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values()))
    stats = engine.stats()
    disk, decode = stats["disk"], stats["total"]["decode"]
    expert_bytes = sum(t[0].numel() * t.element_size() for t in LAYERS[NAMES[0]].values())
    warm = 2 * 4  # the warm start's 4 slots per layer are read too
    assert decode["loads"] > 0
    assert disk["reads"] == decode["loads"] + warm
    assert disk["bytes"] == disk["reads"] * expert_bytes
    # Every read is checked, not only a record's first (72 reads of 32 records).
    assert disk["checked"] == disk["reads"] > 2 * 16
    # What a copy from the disk costs is learned from the disk's own copies, and that
    # is what the link tells the policies.
    source = engine.layers[NAMES[0]].experts
    assert source.seconds_per_byte != 1e-10  # (the first guess)
    assert engine.link.expert_seconds(source) == source.copy_seconds()
    engine.write_stats()
    series = scrape(tmp_path / "metrics")
    labels = tuple(sorted({"model_name": "tiny", "engine": "0"}.items()))
    assert series[("specexpert_disk_reads_total", labels)] == disk["reads"]
    assert series[("specexpert_disk_bytes_total", labels)] == disk["bytes"]
    engine.reset_stats()
    assert engine.stats()["disk"]["reads"] == 0


def unreadable_logs(monkeypatch) -> list[tuple]:
    from vllm_specexpert import handback

    logged: list[tuple] = []
    monkeypatch.setattr(handback.logger, "error", lambda *args: logged.append(args))
    return logged


def test_a_failing_read_fails_only_the_rows_that_needed_it(engine, pack, monkeypatch):
    logged = unreadable_logs(monkeypatch)
    name = NAMES[0]
    records = (pack.path / RECORDS_FILE).read_bytes()
    os.truncate(pack.path / RECORDS_FILE, pack.layers[name].record(8)[0])  # 8.. are gone
    x, w, _ = random_routing(4, 16, 4, seed=0)
    ids = torch.tensor(
        [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [0, 12, 5, 6]], dtype=torch.int32
    )
    for _ in range(2):
        out = engine.run_call(LayerRequest(name, slot_kernel, x, w, ids, PassPhases.decode_only(4)))
        # Rows 0 and 2 exact; the others without their unreadable experts (weight 0,
        # not renormalized: their requests fail), never what a failed read left.
        gone = torch.where(ids >= 8, 0.0, w)
        assert torch.equal(out, reference_moe(x, gone, ids, *LAYERS[name].values()))
        assert not out[1].any()
        assert engine.unreadable.take() == [1, 3]
        assert engine.unreadable.take() == []  # taken
    stats = engine.stats()
    assert stats["disk"]["failed"] >= 4
    # The calls run again without the unreadable experts count their copies: every
    # read, failed or not, is still a load (the warm start's 2 x 4 reads aside).
    assert stats["disk"]["reads"] == stats["total"]["decode"]["loads"] + 2 * 4
    # Each unreadable expert logged once, with the cause, not once per call.
    assert sorted(e for entry in logged for e in entry[2]) == [12, 13, 14, 15]
    assert all("EOFError" in entry[3] for entry in logged)
    # The file is whole again: the same experts are read and every row is exact.
    (pack.path / RECORDS_FILE).write_bytes(records)
    out = engine.run_call(LayerRequest(name, slot_kernel, x, w, ids, PassPhases.decode_only(4)))
    assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values()))
    assert engine.unreadable.take() == []


def test_a_changed_record_is_caught_when_read(engine, pack, monkeypatch):
    logged = unreadable_logs(monkeypatch)
    name = NAMES[1]
    offset, _ = pack.layers[name].record(9)
    with open(pack.path / RECORDS_FILE, "r+b") as f:
        f.seek(offset + 64)
        f.write(b"\xff\xff")
    x, w, _ = random_routing(2, 16, 4, seed=0)
    ids = torch.tensor([[9, 10, 11, 12], [10, 11, 12, 13]], dtype=torch.int32)
    out = engine.run_call(LayerRequest(name, slot_kernel, x, w, ids, PassPhases.decode_only(2)))
    gone = torch.where(ids == 9, 0.0, w)
    assert torch.equal(out, reference_moe(x, gone, ids, *LAYERS[name].values()))
    assert engine.unreadable.take() == [0]
    assert logged[0][2] == [9] and "expert 9 does not match its checksum" in logged[0][3]
    # The slot it was read into holds no expert: it is never run from what the failed
    # read left there.
    assert engine.layers[name].cache.expert_slot[9] < 0


def test_a_record_changed_after_it_was_read_is_caught_at_the_next_read(engine, pack, monkeypatch):
    logged = unreadable_logs(monkeypatch)
    name, reference = NAMES[1], LAYERS[NAMES[1]].values()
    x, w, _ = random_routing(1, 16, 4, seed=1)
    first = torch.tensor([[9, 10, 11, 12]], dtype=torch.int32)
    others = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    assert torch.equal(
        engine.run_call(LayerRequest(name, slot_kernel, x, w, first, PassPhases.decode_only(1))),
        reference_moe(x, w, first, *reference),
    )
    engine.run_call(
        LayerRequest(name, slot_kernel, x, w, others, PassPhases.decode_only(1))
    )  # 9 is evicted
    assert engine.layers[name].cache.expert_slot[9] < 0
    records = (pack.path / RECORDS_FILE).read_bytes()
    offset, _ = pack.layers[name].record(9)
    with open(pack.path / RECORDS_FILE, "r+b") as f:
        f.seek(offset + 64)
        f.write(b"\xff\xff")
    out = engine.run_call(LayerRequest(name, slot_kernel, x, w, first, PassPhases.decode_only(1)))
    gone = torch.where(first == 9, 0.0, w)
    assert torch.equal(out, reference_moe(x, gone, first, *reference))
    assert engine.unreadable.take() == [0]
    assert logged and logged[-1][2] == [9]
    assert engine.layers[name].cache.expert_slot[9] < 0
    assert engine.stats()["disk"]["failed"] == 1
    # Restored: read again when next needed, and exact.
    (pack.path / RECORDS_FILE).write_bytes(records)
    out = engine.run_call(LayerRequest(name, slot_kernel, x, w, first, PassPhases.decode_only(1)))
    assert torch.equal(out, reference_moe(x, w, first, *reference))
    assert engine.unreadable.take() == []


def test_a_large_gather_keeps_only_a_few_buffers(pack):
    disk = Disk(pack, depth=2)
    layer = pack.layers[NAMES[0]]
    buffers = disk.read(layer, np.arange(10))
    disk.release(buffers)
    assert [len(free) for free in disk._free.values()] == [4]  # twice the depth
    disk.close()


def test_a_large_transfer_holds_twice_the_queue_depth_of_buffers(pack):
    disk = Disk(pack, depth=2)
    layer = pack.layers[NAMES[0]]
    seen: dict[int, torch.Tensor] = {}
    arrived: list[int] = []

    def arrive(i: int, buffer: torch.Tensor) -> None:
        seen[buffer.data_ptr()] = buffer
        arrived.append(i)

    disk.read_each(layer, np.arange(12), arrive)
    assert sorted(arrived) == list(range(12))  # every expert, by its position
    assert len(seen) <= 4  # twice the depth, reused, not one buffer per expert
    disk.close()
