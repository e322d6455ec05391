"""The disk tier under the engine, without vLLM: toy layers written to a pack, read back
by the link's copies (demand and prefetch), exact against the reference; counters in the
stats and on ``/metrics``; a failing read fails the rows that needed it (the call runs
without its experts, every other row exact), never runs what it left in a slot."""

import os
import threading
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from moe_reference import random_layer, random_routing, reference_moe, slot_kernel
from test_metrics import scrape

from vllm_specexpert import metrics
from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.phases import PassPhases
from vllm_specexpert.tiers import disk_reader
from vllm_specexpert.tiers.disk import Disk
from vllm_specexpert.tiers.expert_pack import RECORDS_FILE, ExpertPack
from vllm_specexpert.tiers.kernel_form import KernelForm
from vllm_specexpert.tiers.pack_writer import write_pack

NAMES = [f"model.layers.{i}.mlp.experts" for i in range(2)]
CHECKPOINT_FORM = KernelForm(layout="checkpoint", dtype="bfloat16")
"""The reference kernel reads the checkpoint's layout."""
LAYERS = {name: random_layer(seed=i) for i, name in enumerate(NAMES)}


@pytest.fixture
def pack(tmp_path) -> ExpertPack:
    write_pack(
        tmp_path / "pack",
        [(name, 16) for name in NAMES],
        lambda name, e: {k: t[e] for k, t in LAYERS[name].items()},
        {"model": "toy", "checkpoint_files": []},
        CHECKPOINT_FORM,
    )
    return ExpertPack(tmp_path / "pack")


@pytest.fixture
def engine(pack, tmp_path, monkeypatch):
    (tmp_path / "metrics").mkdir()
    monkeypatch.setenv(metrics.DIRECTORY_ENV, str(tmp_path / "metrics"))
    monkeypatch.setenv(metrics.MODEL_NAME_ENV, "tiny")
    engine = OffloadEngine(SpecExpertConfig.from_dict({"budget": 0.25}), torch.device("cpu"))
    engine.store.tiers.append(Disk(pack, depth=2))
    for index, name in enumerate(NAMES):
        engine.add_layer(name, engine.store.tier("disk").layer(name), top_k=4, index=index)
    engine.start()
    yield engine
    engine.close()


def test_every_load_is_a_read_and_the_output_is_exact(engine, tmp_path):
    for step in range(4):
        for name in NAMES:
            x, w, ids = random_routing(3, 16, 4, seed=step)
            out = engine.run_call(
                LayerCall(name, slot_kernel, x, w, ids, PassPhases.decode_only(3))
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


class ToyModel:
    """A token model around the two MoE layers: token and position embeddings, per layer
    a router (top 4 of 16, softmax weights) and a residual MoE with RMS norm, a head.
    ``moe(name, x, w, ids)`` runs a layer."""

    def __init__(self, vocab: int = 64, hidden: int = 32, positions: int = 64, seed: int = 7):
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(vocab, hidden, generator=g).bfloat16()
        self.position = torch.randn(positions, hidden, generator=g).bfloat16()
        self.routers = [torch.randn(hidden, 16, generator=g) for _ in NAMES]
        self.head = torch.randn(hidden, vocab, generator=g)

    def logits(self, token: int, position: int, moe) -> torch.Tensor:
        h = (self.embed[token] + self.position[position])[None]
        for name, router in zip(NAMES, self.routers, strict=True):
            weights, ids = torch.topk(torch.softmax(h.float() @ router, -1), 4)
            y = (h.float() + moe(name, h, weights, ids.to(torch.int32)).float())[0]
            h = (y * torch.rsqrt(y.pow(2).mean() + 1e-6)).bfloat16()[None]
        return h.float()[0] @ self.head

    def greedy(self, moe, steps: int) -> tuple[list[int], list[torch.Tensor]]:
        tokens, logits = [0], []
        for position in range(steps):
            logits.append(self.logits(tokens[-1], position, moe))
            tokens.append(int(logits[-1].argmax()))
        return tokens, logits


def test_a_batch_1_decode_from_the_disk_is_exact(engine):
    """Greedy decoding one token a pass, every layer's experts read from the pack (4 of
    16 slots): the same tokens and logits as the model with no offload."""
    model = ToyModel()

    def from_disk(name, x, w, ids):
        request = LayerCall(name, slot_kernel, x, w, ids, PassPhases.decode_only(1))
        return engine.run_call(request)

    def in_memory(name, x, w, ids):
        return reference_moe(x, w, ids, *LAYERS[name].values())

    tokens, logits = model.greedy(from_disk, 32)
    expected_tokens, expected_logits = model.greedy(in_memory, 32)
    assert tokens == expected_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, expected_logits, strict=True))
    assert len(set(tokens)) > 8  # not stuck on a token: the routing moved
    stats = engine.stats()
    decode = stats["total"]["decode"]
    # The passes missed and read what they missed: every load a checked disk read.
    assert decode["misses"] > 0 and decode["loads"] > 0
    assert stats["disk"]["reads"] == stats["disk"]["checked"] == decode["loads"] + 2 * 4


def unreadable_logs(monkeypatch) -> list[tuple]:
    from vllm_specexpert import handback

    logged: list[tuple] = []
    monkeypatch.setattr(handback.logger, "error", lambda *args: logged.append(args))
    return logged


def test_a_failing_read_fails_only_the_rows_that_needed_it(engine, pack, monkeypatch):
    logged = unreadable_logs(monkeypatch)
    name = NAMES[0]
    records = (pack.path / RECORDS_FILE).read_bytes()
    w2 = pack.layers[name].tensors[1]
    os.truncate(pack.path / RECORDS_FILE, w2.at(8))  # 8..'s w2 is gone
    x, w, _ = random_routing(4, 16, 4, seed=0)
    ids = torch.tensor(
        [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [0, 12, 5, 6]], dtype=torch.int32
    )
    for _ in range(2):
        out = engine.run_call(LayerCall(name, slot_kernel, x, w, ids, PassPhases.decode_only(4)))
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
    out = engine.run_call(LayerCall(name, slot_kernel, x, w, ids, PassPhases.decode_only(4)))
    assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values()))
    assert engine.unreadable.take() == []


def test_each_unreadable_expert_is_logged_with_its_own_cause(engine, pack, monkeypatch):
    # Expert 9's w13 changed, then 10's w2: logged once each, each with the tensor that
    # failed in it (the second line quoted the first expert's cause, logged before).
    logged = unreadable_logs(monkeypatch)
    name = NAMES[1]
    for expert, tensor in ((9, 0), (10, 1)):
        with open(pack.path / RECORDS_FILE, "r+b") as f:
            f.seek(pack.layers[name].tensors[tensor].at(expert) + 64)
            f.write(b"\xff\xff")
    x, w, _ = random_routing(1, 16, 4, seed=0)
    first = torch.tensor([[9, 1, 2, 3]], dtype=torch.int32)
    both = torch.tensor([[9, 10, 2, 3]], dtype=torch.int32)
    for ids in (first, both):
        engine.run_call(LayerCall(name, slot_kernel, x, w, ids, PassPhases.decode_only(1)))
    assert [entry[2] for entry in logged] == [[9], [10]]
    assert "expert 9's w13_weight does not match" in logged[0][3]
    assert "expert 10's w2_weight does not match" in logged[1][3]


def test_a_changed_record_is_caught_when_read(engine, pack, monkeypatch):
    logged = unreadable_logs(monkeypatch)
    name = NAMES[1]
    offset = pack.layers[name].tensors[0].at(9)
    with open(pack.path / RECORDS_FILE, "r+b") as f:
        f.seek(offset + 64)
        f.write(b"\xff\xff")
    x, w, _ = random_routing(2, 16, 4, seed=0)
    ids = torch.tensor([[9, 10, 11, 12], [10, 11, 12, 13]], dtype=torch.int32)
    out = engine.run_call(LayerCall(name, slot_kernel, x, w, ids, PassPhases.decode_only(2)))
    gone = torch.where(ids == 9, 0.0, w)
    assert torch.equal(out, reference_moe(x, gone, ids, *LAYERS[name].values()))
    assert engine.unreadable.take() == [0]
    assert (
        logged[0][2] == [9] and "expert 9's w13_weight does not match its checksum" in logged[0][3]
    )
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
        engine.run_call(LayerCall(name, slot_kernel, x, w, first, PassPhases.decode_only(1))),
        reference_moe(x, w, first, *reference),
    )
    engine.run_call(
        LayerCall(name, slot_kernel, x, w, others, PassPhases.decode_only(1))
    )  # 9 is evicted
    assert engine.layers[name].cache.expert_slot[9] < 0
    records = (pack.path / RECORDS_FILE).read_bytes()
    offset = pack.layers[name].tensors[1].at(9)
    with open(pack.path / RECORDS_FILE, "r+b") as f:
        f.seek(offset + 64)
        f.write(b"\xff\xff")
    out = engine.run_call(LayerCall(name, slot_kernel, x, w, first, PassPhases.decode_only(1)))
    gone = torch.where(first == 9, 0.0, w)
    assert torch.equal(out, reference_moe(x, gone, first, *reference))
    assert engine.unreadable.take() == [0]
    assert logged and logged[-1][2] == [9]
    assert engine.layers[name].cache.expert_slot[9] < 0
    assert engine.stats()["disk"]["failed"] == 1
    # Restored: read again when next needed, and exact.
    (pack.path / RECORDS_FILE).write_bytes(records)
    out = engine.run_call(LayerCall(name, slot_kernel, x, w, first, PassPhases.decode_only(1)))
    assert torch.equal(out, reference_moe(x, w, first, *reference))
    assert engine.unreadable.take() == []


class MappedBuffers:
    """Counts the read buffers' memory: every anonymous mapping :mod:`.disk_reader`
    makes, live from its creation until the last tensor or view on it is gone (then
    it is unmapped)."""

    def __init__(self, monkeypatch):
        self.live = self.peak = 0
        self._lock = threading.Lock()
        real = disk_reader.mmap.mmap

        def mapping(fileno: int, length: int):
            region = real(fileno, length)
            with self._lock:
                self.live += length
                self.peak = max(self.peak, self.live)
            weakref.finalize(region, self._unmapped, length)
            return region

        monkeypatch.setattr(disk_reader, "mmap", SimpleNamespace(mmap=mapping))

    def _unmapped(self, length: int) -> None:
        with self._lock:
            self.live -= length


@pytest.mark.parametrize("hidden, inter", [(64, 32), (32, 16)], ids=["aligned", "unaligned"])
def test_reads_land_in_the_slots_and_map_only_what_staging_counts(
    hidden, inter, tmp_path, monkeypatch
):
    # Aligned tensors (w13 8 KiB, w2 4 KiB) are read straight into the slots; the toy
    # ones (2 and 1 KiB) go through a bounce buffer per reader thread under O_DIRECT.
    # Never more is mapped beside the slots than the budget's staging figure.
    layer = random_layer(hidden=hidden, inter=inter)
    write_pack(
        tmp_path / "pack",
        [(NAMES[0], 16)],
        lambda name, e: {k: t[e] for k, t in layer.items()},
        {"model": "toy", "checkpoint_files": []},
        CHECKPOINT_FORM,
    )
    disk = Disk(ExpertPack(tmp_path / "pack"), depth=2)
    experts = disk.layer(NAMES[0])
    print(f"O_DIRECT: {disk.direct}; staging {experts.staging_nbytes} bytes")
    slots = {k: disk_reader.aligned_empty((8, *t.shape[1:]), t.dtype) for k, t in layer.items()}
    mapped = MappedBuffers(monkeypatch)
    chosen = np.array([3, 15, 0, 7, 9, 1, 12, 4])
    experts.copy_into(chosen, np.arange(8)[::-1].copy(), slots)
    for key, tensor in layer.items():
        assert torch.equal(slots[key], tensor[chosen[::-1].copy()])
    assert mapped.peak <= experts.staging_nbytes
    if disk.direct:
        assert (experts.staging_nbytes == 0) == (hidden == 64)
        assert (mapped.peak == 0) == (hidden == 64)
    assert disk.stats.reads == disk.stats.checked == 8
    disk.close()
