"""No read failure breaks an engine or its start (the disk tier, without vLLM): the warm
start skips an expert it cannot read, logs it once and reads it on demand later, failing
only its requests; a ``reconfigure`` whose caches cannot read what they need leaves the
engine as it was, with one error naming the experts and ``disk.path``. Each with three
faults: a byte flipped, the file truncated, and a read error from the device (a FUSE
filesystem that fails the expert's reads; where the machine has no FUSE, the error is
raised at the read call instead, and the test prints so)."""

import errno
import os
from pathlib import Path

import pytest
import torch
from faulty_fs import mount_or_reason
from moe_reference import random_routing, reference_moe, slot_kernel
from test_disk_engine import unreadable_logs
from test_mapped_pack import LAYERS, NAMES, toy_pack

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.phases import PassPhases
from vllm_specexpert.tiers import disk_reader
from vllm_specexpert.tiers.disk import Disk
from vllm_specexpert.tiers.expert_pack import RECORDS_FILE, ExpertPack

LAYER = NAMES[1]
"""(its experts' w13 8 KiB, w2 4 KiB: a device's bad block fails one expert only)"""
BROKEN = 7
"""The expert made unreadable: the warm start reads experts 0..7 at budget 0.5."""
FAULTS = ["flipped", "truncated", "device"]


class Fault:
    """Makes expert :data:`BROKEN`'s ``w2_weight`` of :data:`LAYER` unreadable one way
    (truncated: experts 7.. of it), and restores it."""

    def __init__(self, kind: str, pack: ExpertPack, tmp_path: Path, monkeypatch) -> None:
        self.kind, self.pack, self.monkeypatch = kind, pack, monkeypatch
        self.records = pack.path / RECORDS_FILE
        self.saved = self.records.read_bytes()
        w2 = pack.layers[LAYER].tensors[1]
        self.range = (w2.at(BROKEN), w2.at(BROKEN) + w2.nbytes)
        self.mount = None
        self.path = pack.path
        """Where the engine opens the pack (the FUSE mount for a device error)."""
        if kind == "device":
            mount = mount_or_reason(pack.path, tmp_path / "mount")
            if isinstance(mount, str):
                print(f"{mount}: the read error is raised at the read call instead")
            else:
                self.mount, self.path = mount, mount.mountpoint

    def inject(self) -> None:
        if self.kind == "flipped":
            with open(self.records, "r+b") as f:
                f.seek(self.range[0] + 100)
                f.write(bytes([self.saved[self.range[0] + 100] ^ 0x01]))
        elif self.kind == "truncated":
            os.truncate(self.records, self.range[0])
        elif self.mount is not None:
            self.mount.fail(RECORDS_FILE, [self.range])
        else:
            real, (start, end) = os.preadv, self.range

            def failing(fd, buffers, offset):
                if offset < end and start < offset + sum(len(b) for b in buffers):
                    raise OSError(errno.EIO, "Input/output error (injected at the read call)")
                return real(fd, buffers, offset)

            self.monkeypatch.setattr(disk_reader.os, "preadv", failing)

    def restore(self) -> None:
        if self.kind in ("flipped", "truncated"):
            self.records.write_bytes(self.saved)
        elif self.mount is not None:
            self.mount.fail(RECORDS_FILE, [])
        else:
            self.monkeypatch.undo()

    def close(self) -> None:
        if self.mount is not None:
            self.mount.close()


@pytest.fixture(params=FAULTS)
def fault(request, tmp_path, monkeypatch):
    made = Fault(request.param, toy_pack(tmp_path / "pack"), tmp_path, monkeypatch)
    yield made
    made.close()


def started(path: Path, budget: float, opened=lambda: None) -> OffloadEngine:
    """An engine on the pack at ``path``; ``opened()`` runs once the pack is opened and
    checked, before the warm start reads it (a truncated file is refused at the open)."""
    engine = OffloadEngine(SpecExpertConfig.from_dict({"budget": budget}), torch.device("cpu"))
    engine.store.tiers.append(Disk(ExpertPack(path), depth=2))
    opened()
    for index, name in enumerate(NAMES):
        engine.add_layer(name, engine.store.tier("disk").layer(name), top_k=4, index=index)
    engine.start()
    return engine


IDS = torch.tensor([[BROKEN, 0, 1, 2], [0, 1, 2, 4]], dtype=torch.int32)
"""Row 0 needs the broken expert, row 1 only readable ones (the truncation leaves 0..6)."""


def run(engine: OffloadEngine) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode call of :data:`IDS` on :data:`LAYER`: its output and the reference's with
    the broken expert's weight at 0."""
    x, w, _ = random_routing(2, 16, 4, hidden=64, seed=5)
    out = engine.run_call(LayerCall(LAYER, slot_kernel, x, w, IDS, PassPhases.decode_only(2)))
    without = torch.where(IDS == BROKEN, 0.0, w)
    return out, reference_moe(x, without, IDS, *LAYERS[LAYER].values())


def exact(engine: OffloadEngine) -> bool:
    x, w, _ = random_routing(2, 16, 4, hidden=64, seed=5)
    out = engine.run_call(LayerCall(LAYER, slot_kernel, x, w, IDS, PassPhases.decode_only(2)))
    return torch.equal(out, reference_moe(x, w, IDS, *LAYERS[LAYER].values()))


def test_the_warm_start_skips_an_expert_it_cannot_read(fault, monkeypatch):
    logged = unreadable_logs(monkeypatch)
    engine = started(fault.path, budget=0.5, opened=fault.inject)
    try:
        cache = engine.layers[LAYER].cache
        assert cache.expert_slot[BROKEN] < 0  # not resident: its slot holds no expert
        assert (cache.expert_slot[:BROKEN] >= 0).all()
        assert [entry[2] for entry in logged] == [[BROKEN]]  # logged once, at the start
        assert "at the warm start" in logged[0][3]
        for _ in range(2):  # read on demand, failing only the row that needs it
            out, expected = run(engine)
            assert torch.equal(out, expected)
            assert engine.unreadable.take() == [0]
        assert len(logged) == 1  # (once per expert)
        fault.restore()
        assert exact(engine) and engine.unreadable.take() == []
    finally:
        engine.close()


def test_a_reconfigure_that_cannot_read_leaves_the_engine_as_it_was(fault, monkeypatch):
    unreadable_logs(monkeypatch)
    engine = started(fault.path, budget=0.25)  # (warm start: experts 0..3)
    try:
        assert exact(engine)
        calls = engine.stats()["total"]["decode"]["calls"]
        fault.inject()
        with pytest.raises(SpecExpertConfigError) as error:
            engine.reconfigure(SpecExpertConfig.from_dict({"budget": 0.5}))
        assert error.value.field_name == "disk.path" and "\n" not in str(error.value)
        assert f"{LAYER}'s experts [{BROKEN}]" in error.value.problem
        assert "runs on as it was" in error.value.problem
        # As it was: its config, slots and counters; it serves, and fails only the row
        # that needs the broken expert.
        assert engine.config.budget == 0.25
        assert {la.cache.num_slots for la in engine.layers.values()} == {4}
        assert engine.stats()["total"]["decode"]["calls"] == calls
        out, expected = run(engine)
        assert torch.equal(out, expected) and engine.unreadable.take() == [0]
        fault.restore()
        assert exact(engine)
        engine.reconfigure(SpecExpertConfig.from_dict({"budget": 0.5}))  # readable again
        assert {la.cache.num_slots for la in engine.layers.values()} == {8}
        assert engine.layers[LAYER].cache.expert_slot[BROKEN] >= 0
        assert exact(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("fault", ["flipped"], indirect=True)
def test_the_restart_after_the_warm_up_skips_what_it_cannot_read(fault, monkeypatch):
    # (the rebuild that follows vLLM's warm-up passes is part of the start)
    logged = unreadable_logs(monkeypatch)
    engine = started(fault.path, budget=0.5)
    try:
        fault.inject()
        engine.restart()
        assert engine.layers[LAYER].cache.expert_slot[BROKEN] < 0
        assert [entry[2] for entry in logged] == [[BROKEN]]
        out, expected = run(engine)
        assert torch.equal(out, expected) and engine.unreadable.take() == [0]
    finally:
        engine.close()
