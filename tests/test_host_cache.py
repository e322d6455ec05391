"""The disk tier's host cache (CUDA's pinned rows between the disk and the device slots),
run on this machine with the host as the "device": exact against the reference; a device
miss the rows hold is no disk read, the rows' least recently used expert goes first; a
copy longer than the rows runs in turns; a row whose copy out may still run is waited
for before it is read over; a failed read leaves its row empty. ``disk.host_cache`` is
sized by the budget's function from the host's memory, and refused on the CPU build."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from moe_reference import random_layer, random_routing, reference_moe, slot_kernel

from vllm_specexpert.budget_plan import size_host_cache
from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.config.sizing import MemoryReport, SizingSettings
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.phases import PassPhases
from vllm_specexpert.tiers.disk import Disk
from vllm_specexpert.tiers.expert_pack import ExpertPack
from vllm_specexpert.tiers.host_cache import HostCache, HostRows
from vllm_specexpert.tiers.kernel_form import KernelForm
from vllm_specexpert.tiers.pack_writer import write_pack
from vllm_specexpert.tiers.store import ExpertsUnreadable

NAME = "model.layers.0.mlp.experts"
LAYER = random_layer(hidden=64, inter=32, seed=0)
EXPERT_BYTES = 8192 + 4096


@pytest.fixture
def pack(tmp_path) -> ExpertPack:
    write_pack(
        tmp_path / "pack",
        [(NAME, 16)],
        lambda name, e: {k: t[e] for k, t in LAYER.items()},
        {"model": "toy", "checkpoint_files": []},
        KernelForm(layout="checkpoint", dtype="bfloat16"),
    )
    return ExpertPack(tmp_path / "pack")


@pytest.fixture
def engine(pack):
    """4 device slots (budget 0.25 of 16 experts, top_k 4) over 8 host rows."""
    engine = OffloadEngine(SpecExpertConfig.from_dict({"budget": 0.25}), torch.device("cpu"))
    disk = Disk(pack, depth=2)
    engine.store.tiers.append(disk)
    disk.host_cache = HostCache(rows_per_layer=8, pinned=False)
    engine.add_layer(NAME, disk.layer(NAME), top_k=4, index=0)
    engine.start()
    yield engine
    engine.close()


def run(engine, experts: list[int]) -> None:
    x, w, _ = random_routing(1, 16, 4, hidden=64, seed=sum(experts))
    ids = torch.tensor([experts], dtype=torch.int32)
    out = engine.run_call(LayerCall(NAME, slot_kernel, x, w, ids, PassPhases.decode_only(1)))
    assert torch.equal(out, reference_moe(x, w, ids, *LAYER.values()))


def test_a_device_miss_the_rows_hold_is_not_read_from_disk_and_the_oldest_row_goes(engine):
    reads = []
    for experts in ([0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [8, 9, 10, 11], [0, 1, 2, 3]):
        run(engine, experts)
        reads.append(engine.stats()["disk"]["reads"])
    # 0-3 come back from the rows twice; 8-11 push out 4-7, used longer ago than 0-3.
    assert reads == [4, 8, 8, 12, 12]
    run(engine, [4, 5, 6, 7])
    stats = engine.stats()["disk"]
    assert stats["reads"] == 16
    host = stats["host_cache"]
    assert (host["hits"], host["misses"]) == (8, 16)
    assert host["rows_per_layer"] == 8 and host["bytes"] == 8 * EXPERT_BYTES
    # Every device miss copied: 0-3 were loaded at start (the warm start, through the rows).
    assert engine.stats()["total"]["decode"]["loads"] == 20
    assert "host cache 8 experts per layer" in engine.summary()


def test_a_copy_longer_than_the_rows_runs_in_turns(pack):
    disk = Disk(pack, depth=2)
    disk.host_cache = HostCache(rows_per_layer=3, pinned=False)
    experts = disk.layer(NAME)
    out = {k: torch.zeros((10, *t.shape[1:]), dtype=t.dtype) for k, t in LAYER.items()}
    experts.copy_into(np.arange(10), np.arange(10)[::-1].copy(), out)
    for name, tensor in LAYER.items():
        assert torch.equal(out[name], tensor[:10].flip(0))
    rows = disk.host_cache.layers[NAME]
    assert rows.num_rows == 3 and sorted(rows.row_of) == [7, 8, 9]
    disk.close()


class FakeReader:
    """Reads expert ``e`` as the value ``e`` everywhere; fails the experts in ``failing``
    (once each); logs each read as it starts."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.failing: set[int] = set()

    def read_rows(self, experts, destinations, rows) -> None:
        self.log.append(("read", experts.tolist()))
        for expert, row in zip(experts.tolist(), rows, strict=True):
            for tensor in destinations.values():
                tensor[row] = expert
        failed = sorted(self.failing & set(experts.tolist()))
        self.failing -= set(failed)
        if failed:
            raise ExpertsUnreadable(NAME, dict.fromkeys(failed, "OSError: injected"))


class FakeCopyDone:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(("waited", self.name))


def test_a_row_is_read_over_only_after_its_copy_out_and_a_failed_read_leaves_it_empty():
    log: list = []
    rows = HostRows({"w": ((2,), torch.float32)}, rows=2, pinned=False)
    reader = FakeReader(log)
    rows.hold(np.array([1, 2]), reader)
    rows.copy_done = [FakeCopyDone(log, "copy of 1"), FakeCopyDone(log, "copy of 2")]
    held = rows.hold(np.array([2, 3]), reader)  # 3 takes 1's row: its copy first
    assert log[1:] == [("waited", "copy of 1"), ("read", [3])]
    assert rows.tensors["w"][held].tolist() == [[2.0, 2.0], [3.0, 3.0]]
    reader.failing = {4}
    with pytest.raises(ExpertsUnreadable):
        rows.hold(np.array([4]), reader)
    assert 4 not in rows.row_of and 2 in rows.row_of  # (4 took 3's row, and holds nothing)
    held = rows.hold(np.array([4]), reader)  # read again, now whole
    assert log[-1] == ("read", [4]) and rows.tensors["w"][held].tolist() == [[4.0, 4.0]]


def test_the_host_cache_is_sized_by_the_budgets_function_from_the_hosts_memory(pack, monkeypatch):
    """auto: the host's free memory less the 1 GiB reserve and the draft's INT4
    experts, no KV cache or workspace; a size: its bytes over the MoE layers; too
    little memory: the field and the fix."""
    GiB = 1 << 30
    free = {"bytes": 0}

    def report(device, settings, freed_bytes=0):
        assert device.type == "cpu" and settings.kv_cache_bytes == 0
        return MemoryReport(total_bytes=64 * GiB, free_bytes=free["bytes"], kv_cache_bytes=0)

    monkeypatch.setattr("vllm_specexpert.budget_plan.memory_report", report)
    sizing = SizingSettings(moe_layers=48, moe_intermediate_size=32, max_num_batched_tokens=2048)
    experts = Disk(pack, depth=1).layer(NAME)

    def rows(host_cache) -> int:
        config = SpecExpertConfig.from_dict({"disk": {"path": "x", "host_cache": host_cache}})
        return size_host_cache(config, sizing, experts, top_k=4).slots_per_layer

    free["bytes"] = GiB + 10 * 48 * EXPERT_BYTES
    assert rows(None) == 10  # (auto: the reserve only)
    # The lookahead draft's INT4 experts, built later in host memory, are left their
    # bytes; its decoded slots, on the device, take none of the host's.
    sizing.draft_host_bytes, sizing.draft_bytes = 4 * 48 * EXPERT_BYTES, 20 * GiB
    assert rows(None) == 6
    sizing.draft_host_bytes = sizing.draft_bytes = 0
    free["bytes"] = 20 * GiB
    assert rows(None) == 16  # (every expert)
    assert rows(f"{5 * 48 * EXPERT_BYTES}B") == 5
    free["bytes"] = GiB + 3 * 48 * EXPERT_BYTES
    with pytest.raises(SpecExpertConfigError) as error:
        rows(None)
    assert error.value.field_name == "disk.host_cache"


def test_host_cache_is_refused_on_the_cpu_build(monkeypatch):
    from vllm.platforms import current_platform

    from vllm_specexpert.validate import _check_disk

    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    config = SpecExpertConfig.from_dict({"disk": {"path": "x", "host_cache": "8GiB"}})
    with pytest.raises(SpecExpertConfigError, match="slots are in host memory") as error:
        _check_disk(config, SimpleNamespace(model="m", dtype=torch.bfloat16))
    assert error.value.field_name == "disk.host_cache"


@pytest.mark.parametrize("asked", [None, True])
def test_on_cuda_the_disk_tier_turns_async_scheduling_off_and_refuses_it_asked_for(
    monkeypatch, asked
):
    """Failed reads reach the scheduler on the step's output: a step scheduled before
    it (async scheduling) would run the failed requests once more."""
    from vllm.platforms import current_platform

    from vllm_specexpert.validate import prepare_engine_args

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    args = SimpleNamespace(
        moe_backend="auto", async_scheduling=asked, worker_extension_cls="", scheduler_cls=None
    )
    config = SpecExpertConfig.from_dict({"disk": {"path": "x"}})
    if asked:
        with pytest.raises(SpecExpertConfigError, match="async-scheduling") as error:
            prepare_engine_args(args, config)
        assert error.value.field_name == "disk"
        return
    prepare_engine_args(args, config)
    assert args.async_scheduling is False
    other = SimpleNamespace(**{**vars(args), "async_scheduling": None})
    prepare_engine_args(other, SpecExpertConfig.from_dict({}))  # (without disk: left alone)
    assert other.async_scheduling is None
