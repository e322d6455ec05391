"""The expert pack and the disk reader: records written from the checkpoint come back
bit for bit through aligned (O_DIRECT) reads; a truncated, corrupted, unfinished or
foreign pack is refused with one error naming ``disk.path``."""

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vllm_specexpert.artifacts import model_fingerprint
from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.tiers.checkpoint_experts import CheckpointExperts
from vllm_specexpert.tiers.disk_reader import (
    ALIGN,
    DiskFile,
    DiskReader,
    aligned_buffer,
)
from vllm_specexpert.tiers.expert_pack import (
    RECORDS_FILE,
    CorruptRecord,
    ExpertPack,
    checkpoint_files,
)
from vllm_specexpert.tiers.pack_writer import write_pack

MODEL = Path(__file__).parent.parent / "vllm_specexpert" / "assets" / "tiny-qwen3-moe"
LAYERS = [f"model.layers.{i}.mlp.experts" for i in (0, 1)]


def pack_of(model: Path, out: Path) -> ExpertPack:
    source = CheckpointExperts(model)
    write_pack(
        out,
        source.layers(),
        source,
        {
            "model": str(model),
            "model_fingerprint": model_fingerprint(model),
            "checkpoint_files": checkpoint_files(model),
        },
    )
    return ExpertPack(out, model=model)


@pytest.fixture(scope="module")
def pack(tmp_path_factory) -> ExpertPack:
    return pack_of(MODEL, tmp_path_factory.mktemp("pack"))


def checkpoint_expert(layer: str, expert: int) -> dict[str, torch.Tensor]:
    """The expert as the checkpoint has it, read here (not through the code under test)."""
    with safe_open(str(MODEL / "model.safetensors"), "pt") as f:
        gate, up, down = (
            f.get_tensor(f"{layer}.{expert}.{p}.weight")
            for p in ("gate_proj", "up_proj", "down_proj")
        )
    return {"w13_weight": torch.cat([gate, up]), "w2_weight": down}


def read(pack: ExpertPack, layer: str, expert: int, direct: bool = True) -> torch.Tensor:
    entry = pack.layers[layer]
    offset, length = entry.record(expert)
    buffer = aligned_buffer(entry.record_bytes)
    file = DiskFile(pack.path / RECORDS_FILE, direct=direct)
    try:
        DiskReader(file, 2).submit(buffer, offset, length).result()
    finally:
        file.close()
    return buffer


def test_every_record_reads_back_as_the_checkpoint_has_it(pack):
    reader = DiskReader(DiskFile(pack.path / RECORDS_FILE), depth=4)
    print(f"O_DIRECT on {pack.path}: {reader.file.direct}")
    jobs = []
    for name in LAYERS:
        layer = pack.layers[name]
        assert layer.num_experts == 64 and layer.record_bytes % ALIGN == 0
        for expert in range(layer.num_experts):
            offset, length = layer.record(expert)
            assert offset % ALIGN == 0
            buffer = aligned_buffer(layer.record_bytes)
            jobs.append((layer, expert, buffer, reader.submit(buffer, offset, length)))
    for layer, expert, buffer, job in jobs:
        job.result()
        pack.check_record(layer, expert, buffer)
        got = pack.unpack(layer, buffer)
        want = checkpoint_expert(layer.name, expert)
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key])
    assert reader.stats.reads == 128
    assert reader.stats.bytes == 128 * pack.layers[LAYERS[0]].data_bytes
    reader.close()


def test_a_changed_byte_is_caught_by_its_records_checksum(pack, tmp_path):
    copy = tmp_path / "pack"
    shutil.copytree(pack.path, copy)
    layer = pack.layers[LAYERS[1]]
    offset, _ = layer.record(5)
    with open(copy / RECORDS_FILE, "r+b") as f:
        f.seek(offset + 1000)
        byte = f.read(1)
        f.seek(offset + 1000)
        f.write(bytes([byte[0] ^ 0x10]))
    corrupted = ExpertPack(copy)  # the size is right: found when the record is read
    corrupted.check_record(layer, 4, read(corrupted, LAYERS[1], 4))
    with pytest.raises(CorruptRecord, match=r"model\.layers\.1\.mlp\.experts expert 5"):
        corrupted.check_record(layer, 5, read(corrupted, LAYERS[1], 5))


def test_a_truncated_pack_is_refused_when_opened(pack, tmp_path):
    copy = tmp_path / "pack"
    shutil.copytree(pack.path, copy)
    os.truncate(copy / RECORDS_FILE, pack.manifest.records_bytes - ALIGN)
    with pytest.raises(SpecExpertConfigError, match=r"disk\.path.*truncated"):
        ExpertPack(copy)


def test_an_unfinished_pack_is_refused(pack, tmp_path):
    copy = tmp_path / "pack"
    shutil.copytree(pack.path, copy)
    (copy / "manifest.json").unlink()  # written last: a pack without it was interrupted
    with pytest.raises(SpecExpertConfigError, match=r"disk\.path.*no manifest\.json"):
        ExpertPack(copy)


def test_a_pack_of_another_or_a_changed_checkpoint_is_refused(pack, tmp_path, capsys):
    from vllm_specexpert.cli import main

    shutil.copytree(pack.path, tmp_path / "pack")
    pack = ExpertPack(tmp_path / "pack")
    other = tmp_path / "model"
    shutil.copytree(MODEL, other)
    with safe_open(str(MODEL / "model.safetensors"), "pt") as f:
        names = f.keys()  # (a safetensors handle is not iterable)
        tensors = {k: f.get_tensor(k) for k in names}
        metadata = f.metadata()
    # A copy has the same bytes but another inode: what a build tool compares says
    # "changed", and --verify, comparing every expert, records the copy as it is.
    with pytest.raises(SpecExpertConfigError, match=r"disk\.path.*out of date.*inode differs"):
        ExpertPack(pack.path, model=other)
    main(["pack", str(other), "--out", str(pack.path), "--verify"])
    assert "512 of 512 experts match" in capsys.readouterr().out
    ExpertPack(pack.path, model=other)
    # A fine-tune outside every sampled block, same names, shapes and size: its mtime
    # says so, and --verify names the experts that differ and records nothing.
    key = f"{LAYERS[1]}.5.up_proj.weight"
    tensors[key] = tensors[key].clone()
    tensors[key][3, 7] += 1
    save_file(tensors, str(other / "model.safetensors"), metadata=metadata)
    assert (other / "model.safetensors").stat().st_size == (
        MODEL / "model.safetensors"
    ).stat().st_size
    with pytest.raises(SpecExpertConfigError, match=r"disk\.path.*out of date.*mtime_ns"):
        ExpertPack(pack.path, model=other)
    with pytest.raises(SystemExit) as exit_:
        main(["pack", str(other), "--out", str(pack.path), "--verify"])
    printed = capsys.readouterr().out
    assert exit_.value.code == 1
    assert f"{LAYERS[1]} expert 5: w13_weight differs" in printed
    assert "511 of 512 experts match" in printed
    with pytest.raises(SpecExpertConfigError, match=r"out of date"):
        ExpertPack(pack.path, model=other)
    key = f"{LAYERS[0]}.0.down_proj.weight"
    tensors[key] = tensors[key][:, :32].contiguous()  # one shape changed
    save_file(tensors, str(other / "model.safetensors"))
    with pytest.raises(SpecExpertConfigError, match=r"disk\.path.*out of date"):
        ExpertPack(pack.path, model=other)
    (other / "model.safetensors").rename(other / "model-00001-of-00001.safetensors")
    with pytest.raises(SpecExpertConfigError, match=r"disk\.path.*another model"):
        ExpertPack(pack.path, model=other)


def test_without_o_direct_reads_go_through_the_page_cache(pack, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT refused")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    file = DiskFile(pack.path / RECORDS_FILE)
    assert not file.direct
    file.close()
    layer = pack.layers[LAYERS[0]]
    buffer = read(pack, LAYERS[0], 7)
    pack.check_record(layer, 7, buffer)
    assert torch.equal(
        pack.unpack(layer, buffer)["w2_weight"], checkpoint_expert(LAYERS[0], 7)["w2_weight"]
    )


def test_a_record_past_the_end_of_the_file_is_an_error_not_zeros(pack):
    layer = pack.manifest.layers[-1]
    offset, length = layer.record(layer.num_experts)  # one past the last record
    file = DiskFile(pack.path / RECORDS_FILE)
    reader = DiskReader(file, 1)
    with pytest.raises(EOFError, match=r"ends at byte"):
        reader.submit(aligned_buffer(length), offset, length).result()
    assert reader.stats.reads == 0 and reader.stats.bytes == 0
    reader.close()


def test_the_pack_command_writes_a_pack_the_tier_accepts(tmp_path, capsys):
    from vllm_specexpert.cli import main

    main(["pack", str(MODEL), "--out", str(tmp_path / "pack")])
    pack = ExpertPack(tmp_path / "pack", model=MODEL)
    assert [layer.name for layer in pack.manifest.layers] == [
        f"model.layers.{i}.mlp.experts" for i in range(8)
    ]
    assert "8 layers, 512 experts" in capsys.readouterr().out
    main(["pack", str(MODEL), "--out", str(tmp_path / "pack")])  # its own output: rewritten
    ExpertPack(tmp_path / "pack", model=MODEL)


@pytest.mark.parametrize(
    "case, message",
    [
        ("inside", "lies inside the input directory"),
        ("full", "needs 0.05 GB"),
        ("other", "holds other things than an expert pack"),
    ],
)
def test_the_pack_command_refuses_before_any_work(case, message, tmp_path, monkeypatch, capsys):
    from vllm_specexpert.cli import main

    model = tmp_path / "model"
    shutil.copytree(MODEL, model)
    out = {"inside": model / "pack", "full": tmp_path / "pack", "other": tmp_path}[case]
    if case == "full":
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=10 << 20))
    with pytest.raises(SystemExit) as exit_:
        main(["pack", str(model), "--out", str(out)])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not (out / "experts.bin").exists()
