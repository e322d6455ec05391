"""The disk tier under the engine, without vLLM: toy layers written to a pack, read back
by the link's copies (demand and prefetch), exact against the reference; counters in the
stats and on ``/metrics``; a failing read is an error, never zeros in a slot."""

import os

import numpy as np
import pytest
import torch
from moe_reference import random_layer, random_routing, reference_moe, slot_kernel
from test_metrics import scrape

from vllm_specexpert import metrics
from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.phases import PassPhases
from vllm_specexpert.tiers.disk import Disk
from vllm_specexpert.tiers.expert_pack import RECORDS_FILE, ExpertPack, write_pack

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
            out = engine.run(name, slot_kernel, x, w, ids, PassPhases.decode_only(3))
            assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values()))
    stats = engine.stats()
    disk, decode = stats["disk"], stats["total"]["decode"]
    expert_bytes = sum(t[0].numel() * t.element_size() for t in LAYERS[NAMES[0]].values())
    warm = 2 * 4  # the warm start's 4 slots per layer are read too
    assert decode["loads"] > 0
    assert disk["reads"] == decode["loads"] + warm
    assert disk["bytes"] == disk["reads"] * expert_bytes
    # Each record is checked once, at its first read: never more than the experts read.
    assert 0 < disk["checked"] <= min(disk["reads"], 2 * 16)
    engine.write_stats()
    series = scrape(tmp_path / "metrics")
    labels = tuple(sorted({"model_name": "tiny", "engine": "0"}.items()))
    assert series[("specexpert_disk_reads_total", labels)] == disk["reads"]
    assert series[("specexpert_disk_bytes_total", labels)] == disk["bytes"]
    engine.reset_stats()
    assert engine.stats()["disk"]["reads"] == 0


def test_a_failing_read_is_an_error_not_zeros(engine, pack):
    name = NAMES[0]
    os.truncate(pack.path / RECORDS_FILE, pack.layers[name].record(8)[0])  # 8.. are gone
    x, w, _ = random_routing(1, 16, 4, seed=0)
    ids = torch.tensor([[12, 13, 14, 15]], dtype=torch.int32)  # not resident, not on disk
    with pytest.raises(RuntimeError, match="expert copy failed") as error:
        engine.run(name, slot_kernel, x, w, ids, PassPhases.decode_only(1))
    assert isinstance(error.value.__cause__, EOFError)


def test_a_changed_record_is_caught_at_its_first_read(engine, pack):
    name = NAMES[1]
    offset, _ = pack.layers[name].record(9)
    with open(pack.path / RECORDS_FILE, "r+b") as f:
        f.seek(offset + 64)
        f.write(b"\xff\xff")
    x, w, _ = random_routing(1, 16, 4, seed=0)
    ids = torch.tensor([[9, 10, 11, 12]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="expert copy failed") as error:
        engine.run(name, slot_kernel, x, w, ids, PassPhases.decode_only(1))
    assert "expert 9 does not match its checksum" in str(error.value.__cause__)
    # The slot it was read into holds no expert: the next call reads it again (and
    # fails again), it never runs what the failed read left there.
    assert engine.layers[name].cache.expert_slot[9] < 0
    with pytest.raises(RuntimeError, match="expert copy failed"):
        engine.run(name, slot_kernel, x, w, ids, PassPhases.decode_only(1))


def test_a_large_gather_keeps_only_a_few_buffers(pack):
    disk = Disk(pack, depth=2)
    layer = pack.layers[NAMES[0]]
    buffers = disk.read(layer, np.arange(10))
    disk.release(buffers)
    assert [len(free) for free in disk._free.values()] == [4]  # twice the depth
    disk.close()
