"""The mapped residency under the engine, without vLLM: toy layers written to a pack in
the checkpoint's layout (the reference kernel's), the file mapped and the kernel run on
its pages. Exact against the reference at every batch and in prefill, with no slot
memory of its own; pages outside the page cache counted when a launch reads them in; a
file truncated under the engine fails only the rows that needed what is gone (an error
of the call, never a SIGBUS), and the engine reads them again once the file is whole.
Writers are other processes (:mod:`other_writer`), as an operator's would be: while one
holds the file open for writing, every call fails; after, what changed fails."""

import ctypes
import errno
import os

import numpy as np
import pytest
import torch
from moe_reference import random_layer, random_routing, reference_moe, slot_kernel
from other_writer import OtherWriter, wait_for_break, write_from_another_process

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.device_runs import kernel_launch
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.phases import PassPhases
from vllm_specexpert.tiers import mapped
from vllm_specexpert.tiers.disk import Disk
from vllm_specexpert.tiers.expert_pack import RECORDS_FILE, ExpertPack
from vllm_specexpert.tiers.kernel_form import KernelForm
from vllm_specexpert.tiers.pack_writer import write_pack

NAMES = [f"model.layers.{i}.mlp.experts" for i in range(2)]
LAYERS = {name: random_layer(hidden=64, inter=32, seed=i) for i, name in enumerate(NAMES)}
"""Each expert's w13 8 KiB and w2 4 KiB: whole pages."""
MAPPED = {"disk": {"path": "unused", "residency": "mapped"}}


def toy_pack(out) -> ExpertPack:
    """:data:`LAYERS` written to a pack at ``out`` in the reference kernel's layout."""
    write_pack(
        out,
        [(name, 16) for name in NAMES],
        lambda name, e: {k: t[e] for k, t in LAYERS[name].items()},
        {"model": "toy", "checkpoint_files": []},
        KernelForm(layout="checkpoint", dtype="bfloat16"),
    )
    return ExpertPack(out)


@pytest.fixture
def pack(tmp_path) -> ExpertPack:
    return toy_pack(tmp_path / "pack")


def mapped_engine(pack: ExpertPack, pool_reach: int | None = None) -> OffloadEngine:
    """An engine over :data:`NAMES` on ``pack``'s mapping, not started."""
    engine = OffloadEngine(SpecExpertConfig.from_dict(MAPPED), torch.device("cpu"))
    engine.budget.sizing.moe_layers = len(NAMES)  # (what vLLM's adapter counts)
    engine.store.tiers.append(Disk(pack, depth=2, mapped=True))
    assert engine.store.tier("disk").mapping is not None, engine.store.tier("disk").mapping_refused
    for index, name in enumerate(NAMES):
        experts = engine.store.tier("disk").layer(name)
        engine.add_layer(name, experts, top_k=4, index=index, pool_reach=pool_reach)
    return engine


@pytest.fixture
def engine(pack):
    engine = mapped_engine(pack)
    engine.start()
    yield engine
    engine.close()


def call(engine, name, x, w, ids, phases):
    return engine.run_call(LayerCall(name, slot_kernel, x, w, ids, phases))


def drop_page_cache(pack: ExpertPack, name: str, engine: OffloadEngine | None = None) -> bool:
    """Drop the pack's pages from the page cache; whether layer ``name``'s are gone (not
    on tmpfs). Asked more than once: pages still in a per-CPU batch are dropped at a
    later call. ``engine``: its mapping of the layer is dropped first (a page mapped by
    a process stays in the page cache)."""
    fd = os.open(pack.path / RECORDS_FILE, os.O_RDONLY)
    probe = Disk(pack, depth=1, mapped=True)  # (maps page 0, and the pages around it)
    assert probe.mapping is not None
    layer = pack.layers[name]
    start = layer.offset
    if engine is not None:
        engine.store.tier("disk").mapping._advise(start, layer.end - start, mapped.MADV_DONTNEED)
    try:
        for _ in range(3):
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if probe.mapping._missing_bytes(start, layer.end - start) == layer.end - start:
                return True
        return False
    finally:
        os.close(fd)
        probe.close()


def test_the_kernel_runs_on_the_mapped_pages_exactly(engine, pack, monkeypatch):
    mapping = engine.store.tier("disk").mapping
    start, end = mapping.address, mapping.address + pack.manifest.records_bytes
    for name in NAMES:
        cache = engine.layers[name].cache
        assert cache.num_slots == 16  # every expert, whatever the budget
        for tensor in cache.slots.values():  # no memory of its own: the mapping's pages
            assert start <= tensor.data_ptr() < end
    for step, tokens in enumerate([1, 1, 3, 8, 1]):
        for name in NAMES:
            x, w, ids = random_routing(tokens, 16, 4, hidden=64, seed=step)
            out = call(engine, name, x, w, ids, PassPhases.decode_only(tokens))
            assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values()))
    # A prefill (every expert), run in launches of 16 tokens at most: 3 of them.
    monkeypatch.setattr(kernel_launch, "KERNEL_CHUNK_TOKENS", 16)
    launches = []
    kernel = lambda *args, **kw: launches.append(len(args[0])) or slot_kernel(*args, **kw)
    x, w, ids = random_routing(40, 16, 4, hidden=64, seed=9)
    out = engine.run_call(LayerCall(NAMES[1], kernel, x, w, ids, PassPhases.prefill_only(40)))
    assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[NAMES[1]].values()))
    assert launches == [16, 16, 8]
    stats = engine.stats()
    assert stats["disk"]["residency"] == "mapped" and stats["disk"]["failed"] == 0
    assert "mapped: the page cache is the cache" in engine.summary()


def test_pages_outside_the_page_cache_are_read_in_and_counted(engine, pack):
    name = NAMES[1]
    if not drop_page_cache(pack, name):
        print("the filesystem keeps the pack's pages (tmpfs?): nothing to count")
        pytest.skip("the pack's pages cannot be dropped from the page cache here")
    x, w, _ = random_routing(1, 16, 4, hidden=64, seed=0)
    ids = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    out = call(engine, name, x, w, ids, PassPhases.decode_only(1))
    assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values()))
    stats = engine.stats()
    assert stats["disk"]["populated"] == 8  # 4 experts x 2 tensors
    assert stats["disk"]["bytes"] == 4 * (8192 + 4096)
    decode = stats["total"]["decode"]  # the call's loads: what it had read in
    assert decode["loads"] == 4 and decode["bytes_loaded"] == 4 * (8192 + 4096)
    call(engine, name, x, w, ids, PassPhases.decode_only(1))  # present now
    assert engine.stats()["disk"]["populated"] == 8


def test_one_page_out_of_a_short_range_makes_it_missing_and_a_long_range_is_sampled(
    pack, monkeypatch
):
    """A range up to WHOLE_RANGE_PAGES is checked page by page in one call, so a single
    page outside the page cache is found; a longer one costs SAMPLED_PAGES calls."""
    disk = Disk(pack, depth=1, mapped=True)
    mapping = disk.mapping
    assert mapping is not None
    out_of_cache = {mapping.address + 5 * mapped.PAGE}
    calls = []

    def mincore(address, length, vector):
        calls.append(length)
        for page in range(length // mapped.PAGE):
            present = address + page * mapped.PAGE not in out_of_cache
            ctypes.memset(vector + page, int(present), 1)
        return 0

    monkeypatch.setattr(mapped._libc, "mincore", mincore)
    assert not mapping._present(0, 40 * mapped.PAGE)  # (a sample every 2nd page: missed)
    assert calls == [40 * mapped.PAGE]
    assert mapping._present(6 * mapped.PAGE, 40 * mapped.PAGE)
    calls.clear()
    assert mapping._present(0, 64 * mapped.WHOLE_RANGE_PAGES * mapped.PAGE)
    assert calls == [mapped.PAGE] * mapped.SAMPLED_PAGES
    disk.close()


def test_a_truncated_file_fails_only_the_rows_that_needed_what_is_gone(engine, pack):
    name = NAMES[1]
    records = pack.path / RECORDS_FILE
    saved = records.read_bytes()
    w2 = pack.layers[name].tensors[1]
    x, w, _ = random_routing(4, 16, 4, hidden=64, seed=0)
    ids = torch.tensor(
        [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [0, 12, 5, 6]], dtype=torch.int32
    )
    lease = engine.store.tier("disk").mapping.fd
    writer = OtherWriter(records)  # (it waits in its open: the engine holds the lease)
    wait_for_break(lease)
    call(engine, name, x, w, ids, PassPhases.decode_only(4))  # (the engine lets go)
    assert engine.unreadable.take() == [0, 1, 2, 3]  # open for writing: nothing served
    writer.truncate(w2.at(8))  # layer 1's w2 of experts 8.. gone
    writer.close()
    out = call(engine, name, x, w, ids, PassPhases.decode_only(4))  # (a SIGBUS kills pytest)
    gone = torch.where(ids >= 8, 0.0, w)
    assert torch.equal(out, reference_moe(x, gone, ids, *LAYERS[name].values()))
    assert engine.unreadable.take() == [1, 3]
    assert engine.stats()["disk"]["failed"] >= 4
    restore = lambda: call(engine, name, x, w, ids, PassPhases.decode_only(4))
    write_from_another_process(records, [(0, saved)], lease, then=restore)
    engine.unreadable.take()
    out = call(engine, name, x, w, ids, PassPhases.decode_only(4))  # whole again: exact
    assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values()))
    assert engine.unreadable.take() == []


def garbage(pack: ExpertPack, name: str, experts: list[int], tensor: int = 1) -> list:
    """Other bytes for the first 64 of ``experts``' copies of a tensor of layer ``name``,
    and the bytes there now: ``(offset, bytes)`` each."""
    records = (pack.path / RECORDS_FILE).read_bytes()
    entry = pack.layers[name].tensors[tensor]
    spans = [(entry.at(e), records[entry.at(e) : entry.at(e) + 64]) for e in experts]
    return [(at, bytes(255 - b for b in data)) for at, data in spans], spans


def overwrite(pack: ExpertPack, name: str, experts: list[int], tensor: int = 1) -> None:
    """Write other bytes over ``experts``' copies of a tensor of layer ``name`` (through
    the page cache, as a program editing the file would), with no engine running."""
    with open(pack.path / RECORDS_FILE, "r+b") as f:
        for at, data in garbage(pack, name, experts, tensor)[0]:
            f.seek(at)
            f.write(data)


@pytest.mark.parametrize("how", ["pwrite", "mapped"])
def test_a_pack_written_to_under_the_engine_never_serves_what_it_did_not_check(engine, pack, how):
    # Another process opens the pack for writing (pwrite; or a writable shared mapping,
    # written twice to the same page: the second write moved no change time, and went
    # unseen). While it holds the file, every call fails (nothing it wrote reaches the
    # kernel unchecked); once it lets go, only the rows that need what changed fail; the
    # file restored, every row is exact again.
    name = NAMES[1]
    records, lease = pack.path / RECORDS_FILE, engine.store.tier("disk").mapping.fd
    x, w, _ = random_routing(3, 16, 4, hidden=64, seed=2)
    ids = torch.tensor([[0, 1, 2, 3], [8, 9, 10, 11], [9, 4, 5, 6]], dtype=torch.int32)
    out = call(engine, name, x, w, ids, PassPhases.decode_only(3))
    assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values()))
    checked = engine.stats()["disk"]["checked"]
    assert checked == 11  # each expert the call needed, once: the pages were resident
    call(engine, name, x, w, ids, PassPhases.decode_only(3))
    assert engine.stats()["disk"]["checked"] == checked  # checked already, unchanged
    writes, spans = garbage(pack, name, [8, 9])
    writer = OtherWriter(records, mapped=how == "mapped")
    wait_for_break(lease)
    for written in ([], writes[:1], writes[:1], writes[1:]):  # (the same page twice)
        for at, data in written:
            writer.write(at, data)
        call(engine, name, x, w, ids, PassPhases.decode_only(3))
        assert engine.unreadable.take() == [0, 1, 2]  # (the writer holds the file)
    writer.close()
    for _ in range(2):  # (and again at the next call: a bad expert is checked each time)
        out = call(engine, name, x, w, ids, PassPhases.decode_only(3))
        gone = torch.where((ids == 8) | (ids == 9), 0.0, w)
        assert torch.equal(out, reference_moe(x, gone, ids, *LAYERS[name].values()))
        assert engine.unreadable.take() == [1, 2]
    disk = engine.stats()["disk"]
    assert disk["writes_seen"] == 1 and disk["check_s"] > 0
    restore = lambda: call(engine, name, x, w, ids, PassPhases.decode_only(3))
    write_from_another_process(records, spans, lease, then=restore)
    assert engine.unreadable.take() == [0, 1, 2]  # (restore's call: the writer held it)
    out = call(engine, name, x, w, ids, PassPhases.decode_only(3))  # checked again: exact
    assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values()))
    assert engine.unreadable.take() == []
    assert engine.stats()["disk"]["writes_seen"] == 2


IDLE_ENGINE = r"""
import sys
from vllm_specexpert.tiers.disk import Disk
from vllm_specexpert.tiers.expert_pack import ExpertPack
disk = Disk(ExpertPack(sys.argv[1]), depth=1, mapped=True)
assert disk.mapping is not None, disk.mapping_refused
print("held", flush=True)
sys.stdin.read()  # (idle: it never calls; it ends when the test closes its stdin)
disk.close()
"""

OUTAGE_S = 2.0
"""What a writer that opens the pack and closes it at once may cost a busy engine: the
issue's bound. The kernel's lease-break-time (45 s by default) is what it cost before
each holder let go by itself."""


def test_a_writer_stops_a_busy_engine_only_while_it_holds_the_file(engine, pack):
    # Issue 73 (3): two holders of the lease, this busy engine and an idle one in another
    # process; a writer opens the pack and closes it at once. Every holder lets go within
    # its watcher's interval, so the writer waits that long, not the break time, and the
    # busy engine fails calls only while the writer holds the file.
    import subprocess
    import sys
    import threading
    import time

    idle = subprocess.Popen(
        [sys.executable, "-c", IDLE_ENGINE, str(pack.path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert idle.stdout.readline().strip() == "held"
        name = NAMES[0]
        x, w, _ = random_routing(2, 16, 4, hidden=64, seed=7)
        ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
        exact = reference_moe(x, w, ids, *LAYERS[name].values())
        assert torch.equal(call(engine, name, x, w, ids, PassPhases.decode_only(2)), exact)
        timings: dict[str, float] = {}

        def write() -> None:
            started = time.monotonic()
            OtherWriter(pack.path / RECORDS_FILE).close()  # (opens, writes nothing, closes)
            timings["writer_s"] = time.monotonic() - started

        writer = threading.Thread(target=write)
        started = time.monotonic()
        writer.start()
        failed_at = []
        deadline = started + 60
        while time.monotonic() < deadline:
            done = not writer.is_alive()  # (read before the call: a later success counts)
            out = call(engine, name, x, w, ids, PassPhases.decode_only(2))
            if engine.unreadable.take():
                failed_at.append(time.monotonic() - started)
            else:
                assert torch.equal(out, exact)
                if done:
                    break
            time.sleep(0.02)
        writer.join()
        outage = failed_at[-1] - failed_at[0] if failed_at else 0.0
        print(
            f"writer's open and close {timings['writer_s']:.2f} s; calls failed for {outage:.2f} s"
        )
        assert timings["writer_s"] < OUTAGE_S
        assert outage < OUTAGE_S
        assert engine.stats()["disk"]["writes_seen"] == 1
    finally:
        idle.stdin.close()
        assert idle.wait(timeout=60) == 0


def test_a_writer_that_comes_while_a_launch_reads_fails_the_launch(engine, pack):
    # The writer's open waits until the engine asks, after the kernel: the launch read
    # pages no one could write, yet the writer may write from then on, so the call's
    # rows fail (as every call fails while it holds the file).
    name = NAMES[0]
    records, lease = pack.path / RECORDS_FILE, engine.store.tier("disk").mapping.fd
    writers: list[OtherWriter] = []

    def kernel(*args, **kwargs):
        if not writers:
            writers.append(OtherWriter(records))
            wait_for_break(lease)
        return slot_kernel(*args, **kwargs)

    x, w, _ = random_routing(2, 16, 4, hidden=64, seed=5)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    engine.run_call(LayerCall(name, kernel, x, w, ids, PassPhases.decode_only(2)))
    assert engine.unreadable.take() == [0, 1]
    writers[0].close()  # (wrote nothing)
    out = call(engine, name, x, w, ids, PassPhases.decode_only(2))
    assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values()))
    assert engine.unreadable.take() == []


def test_a_writer_that_came_and_went_during_a_launch_fails_it(engine, pack, monkeypatch):
    # (Only when the kernel revoked the lease, after /proc/sys/fs/lease-break-time of a
    # launch: the lease is then found taken again, and the launch may have read what
    # the writer wrote.)
    from vllm_specexpert.tiers.pack_lease import LeaseState

    name, lease = NAMES[0], engine.store.tier("disk").mapping.lease

    def kernel(*args, **kwargs):
        monkeypatch.setattr(lease, "state", lambda: LeaseState.RENEWED)  # once, after it
        return slot_kernel(*args, **kwargs)

    x, w, _ = random_routing(2, 16, 4, hidden=64, seed=6)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    engine.run_call(LayerCall(name, kernel, x, w, ids, PassPhases.decode_only(2)))
    assert engine.unreadable.take() == [0, 1]
    monkeypatch.undo()
    out = call(engine, name, x, w, ids, PassPhases.decode_only(2))  # checked again: exact
    assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values()))


def test_a_pack_open_for_writing_at_the_start_is_not_mapped(pack):
    writer = OtherWriter(pack.path / RECORDS_FILE)
    writer.write(0, (pack.path / RECORDS_FILE).read_bytes()[:1])  # (open: nothing changed)
    try:
        disk = Disk(pack, depth=2, mapped=True)
        assert disk.mapping is None
        assert "is open for writing by another process" in disk.where()
        assert type(disk.layer(NAMES[0])).__name__ == "DiskExperts"
        disk.close()
    finally:
        writer.close()


def test_a_pack_changed_before_the_start_fails_the_rows_that_need_what_changed(pack):
    name = NAMES[0]
    overwrite(pack, name, [5], tensor=0)  # (sizes and manifest as they were)
    engine = mapped_engine(pack)
    engine.start()
    try:
        x, w, _ = random_routing(2, 16, 4, hidden=64, seed=3)
        ids = torch.tensor([[5, 1, 2, 3], [4, 6, 7, 1]], dtype=torch.int32)
        out = call(engine, name, x, w, ids, PassPhases.decode_only(2))
        gone = torch.where(ids == 5, 0.0, w)
        assert torch.equal(out, reference_moe(x, gone, ids, *LAYERS[name].values()))
        assert engine.unreadable.take() == [0]
        assert engine.stats()["disk"]["failed"] == 1
    finally:
        engine.close()


def test_pages_read_in_again_are_checked_again(engine, pack, monkeypatch):
    # Expert 3's pages leave the page cache and come back holding other bytes (the disk
    # returned bad data): the launch that reads them in checks them.
    name = NAMES[0]
    mapping = engine.store.tier("disk").mapping
    x, w, _ = random_routing(1, 16, 4, hidden=64, seed=4)
    ids = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    call(engine, name, x, w, ids, PassPhases.decode_only(1))
    checked = engine.stats()["disk"]["checked"]
    evicted = {mapping._pages(t, 3)[0] for t in pack.layers[name].tensors}
    present = mapping._present
    monkeypatch.setattr(mapping, "_present", lambda o, n: o not in evicted and present(o, n))
    corrupt = mapping.pack.check_read

    def disk_returns_bad_data(layer, tensor, expert, data):
        if expert == 3:
            data = bytes(len(data))
        corrupt(layer, tensor, expert, data)

    monkeypatch.setattr(mapping.pack, "check_read", disk_returns_bad_data)
    out = call(engine, name, x, w, ids, PassPhases.decode_only(1))
    assert torch.equal(
        out, reference_moe(x, torch.where(ids == 3, 0.0, w), ids, *LAYERS[name].values())
    )
    assert engine.unreadable.take() == [0]
    assert engine.stats()["disk"]["checked"] == checked  # (3 failed: counted as failed)
    assert engine.stats()["disk"]["failed"] == 1


def test_a_pack_where_a_lease_cannot_see_every_writer_is_not_mapped(pack, tmp_path):
    # Issue 73 (5): on FUSE the kernel grants the lease, and a write to the daemon's
    # source file breaks none (tried: the lease stayed held); such a pack runs on the
    # slots, which check every read, and the start line says why.
    from faulty_fs import mount_or_reason

    from vllm_specexpert.tiers.pack_lease import LOCAL_FILESYSTEMS, filesystem_of

    fd = os.open(pack.path / RECORDS_FILE, os.O_RDONLY)
    try:  # (the test machine's own filesystem is one a lease sees through)
        local = filesystem_of(fd)[0] in LOCAL_FILESYSTEMS
    finally:
        os.close(fd)
    assert local, "the pack's filesystem here is not one the mapped residency trusts"
    mount = mount_or_reason(pack.path, tmp_path / "mount")
    if isinstance(mount, str):
        pytest.skip(f"{mount}: the refusal on FUSE is not checked")
    try:
        disk = Disk(ExpertPack(mount.mountpoint), depth=2, mapped=True)
        try:
            assert disk.mapping is None
            assert "fuse filesystem" in disk.mapping_refused
            assert "mapping refused" in disk.where() and "fuse" in disk.where()
        finally:
            disk.close()
    finally:
        mount.close()


def test_a_refused_mapping_falls_back_to_the_slots_and_says_so(pack, monkeypatch):
    def refuse(address, length, advice):
        return -1

    monkeypatch.setattr(mapped._libc, "madvise", refuse)
    monkeypatch.setattr(mapped.ctypes, "get_errno", lambda: errno.EINVAL)
    disk = Disk(pack, depth=2, mapped=True)
    assert disk.mapping is None
    assert "mapping refused: the kernel does not populate mapped pages" in disk.where()
    assert type(disk.layer(NAMES[0])).__name__ == "DiskExperts"
    assert disk.stats_dict()["residency"] == "slots"
    disk.close()


def test_what_has_no_miss_to_decide_on_is_refused_with_the_mapped_residency():
    setting = {"miss_policy": "drop"}
    with pytest.raises(SpecExpertConfigError, match=r"disk\.residency 'mapped'") as error:
        SpecExpertConfig.from_dict({**MAPPED, **setting})
    assert error.value.field_name == "miss_policy"
    SpecExpertConfig.from_dict(
        {**MAPPED, "disk": {"path": "unused", "residency": "slots"}, **setting}
    )  # (with the slots it combines)
    assert SpecExpertConfig.from_dict({**MAPPED, "predictor": "router"}).predictor == "router"


@pytest.mark.parametrize("setting", [{"budget": 0.25}, {"cache": "lfu"}], ids=str)
def test_a_setting_the_mapped_residency_does_not_use_is_refused_at_start_and_reconfigure(
    setting,
):
    # Issue 73 (4): both used to be accepted and ignored (the page cache decides).
    (key,) = setting
    with pytest.raises(SpecExpertConfigError, match=r"disk\.residency 'mapped'") as error:
        SpecExpertConfig.from_dict({**MAPPED, **setting})
    assert error.value.field_name == key and "'slots'" in error.value.fix
    running = SpecExpertConfig.from_dict(MAPPED)
    with pytest.raises(SpecExpertConfigError) as error:
        running.changed(setting)
    assert error.value.field_name == key
    slots = {"disk": {"path": "unused", "residency": "slots"}}
    SpecExpertConfig.from_dict({**slots, **setting})  # (the slots use it)


def test_a_prefetch_reads_the_pages_ahead_and_the_launch_then_waits_for_none(engine, pack):
    name = NAMES[1]
    if not drop_page_cache(pack, name):
        print("the filesystem keeps the pack's pages (tmpfs?): nothing to read ahead")
        pytest.skip("the pack's pages cannot be dropped from the page cache here")
    layer = engine.layers[name]
    assert layer.loader.prefetch(np.array([1, 2]), layer.stats.decode) == 0  # (no slot load)
    disk = engine.stats()["disk"]
    assert disk["read_ahead"] == 2 and disk["read_ahead_bytes"] == 2 * (8192 + 4096)
    x, w, _ = random_routing(1, 16, 4, hidden=64, seed=0)
    ids = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    out = call(engine, name, x, w, ids, PassPhases.decode_only(1))
    assert torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values()))
    stats = engine.stats()
    assert stats["disk"]["populated"] == 4  # experts 3 and 4 only: 1 and 2 were on their way
    decode = stats["total"]["decode"]  # every read counted once: ahead, or at the launch
    assert decode["prefetched"] == 2 and decode["loads"] == 4
    assert decode["bytes_loaded"] == 4 * (8192 + 4096)
    layer.loader.prefetch(np.array([1, 2]), layer.stats.decode)  # present: nothing to ask
    assert engine.stats()["disk"]["read_ahead"] == 2


def test_a_layer_past_the_kernels_reach_is_refused_with_the_mapped_residency(pack):
    # The kernel runs on a layer's whole region: 16 experts of w13 [64, 64] are 65536
    # elements, past a reach of 60000 (vLLM's CPU kernel's is 2^31 - 1).
    engine = mapped_engine(pack, pool_reach=60000)
    with pytest.raises(
        SpecExpertConfigError, match=r"65,536 elements .*use disk\.residency 'slots'"
    ) as error:
        engine.start()
    assert error.value.field_name == "disk.residency"
    engine.close()


def test_a_mapped_read_ahead_learns_its_precision_and_stops_reading_for_nothing(engine, pack):
    # Every expert of a mapped pack is "held": the planner's precision, once counted over
    # experts without a slot only, counted none and stayed at its prior of 1, so the
    # read-ahead read every prediction, right or wrong (1.4-1.9x the bytes in 48e). Now
    # it counts the experts whose pages are not in the page cache.
    from vllm_specexpert.planner.prefetch import PrefetchPlanner
    from vllm_specexpert.predict import Prediction

    name = NAMES[1]
    layer = engine.layers[name]
    x, w, _ = random_routing(1, 16, 4, hidden=64, seed=0)
    used = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)

    def steps(predicted: list[int], count: int) -> list[int]:
        """``count`` steps predicting ``predicted``, the pages dropped before each; the
        experts read ahead at each step."""
        planner, read = PrefetchPlanner(top_k=4), []
        for _ in range(count):
            if not drop_page_cache(pack, name, engine):
                print("the filesystem keeps the pack's pages (tmpfs?): nothing to read")
                pytest.skip("the pack's pages cannot be dropped from the page cache here")
            before = engine.stats()["disk"]["read_ahead"]
            ids = torch.tensor([predicted])
            prediction = Prediction(torch.full((1, 4), 0.25), ids)
            # A disk read costs as much as its window: worth it above p = 0.5.
            planner.prefetch(prediction, layer.loader, layer.stats.decode, 1.0, False)
            read.append(engine.stats()["disk"]["read_ahead"] - before)
            call(engine, name, x, w, used, PassPhases.decode_only(1))
            planner.score(prediction, used.numpy(), layer.stats.decode)
        return read

    assert steps([1, 2, 3, 4], 6) == [4] * 6  # right: read ahead at every step
    wrong = steps([9, 10, 11, 12], 6)  # wrong: read ahead once, then never again
    assert wrong[0] == 4 and wrong[2:] == [0] * 4, wrong


def test_the_pack_form_proof_takes_the_first_expert_the_mapping_can_read(pack, monkeypatch):
    # (Issue 65: a bad record of expert 0 stopped the start on either residency.)
    from test_disk_engine import unreadable_logs

    from vllm_specexpert.handback import UnreadableRows
    from vllm_specexpert.layers.pack_form_check import _first_readable

    logged = unreadable_logs(monkeypatch)
    overwrite(pack, NAMES[0], [0, 1], tensor=0)
    disk = Disk(pack, depth=2, mapped=True)
    try:
        index, stored = _first_readable(disk.layer(NAMES[0]), UnreadableRows())
        assert index == 2
        assert torch.equal(stored["w2_weight"][0], LAYERS[NAMES[0]]["w2_weight"][2])
        assert [entry[2] for entry in logged] == [[0], [1]]
        assert "at the pack's form check" in logged[0][3]
    finally:
        disk.close()
