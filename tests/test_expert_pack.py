"""The expert pack and the disk reader: experts written from the checkpoint come back
through aligned (O_DIRECT) reads bit for bit as vLLM's CPU kernel prepacks them; a
truncated, corrupted, unfinished or foreign pack, or one made for another ISA, is refused
with one error naming ``disk.path``."""

import errno
import json
import os
import re
import shutil
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vllm_specexpert.artifacts import model_fingerprint
from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.tiers import pack_writer
from vllm_specexpert.tiers.checkpoint_experts import CheckpointExperts
from vllm_specexpert.tiers.disk import open_disk
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
from vllm_specexpert.tiers.kernel_form import cpu_kernel_form
from vllm_specexpert.tiers.pack_lock import PackLock
from vllm_specexpert.tiers.pack_writer import prepare_pack, write_pack

MODEL = Path(__file__).parent.parent / "vllm_specexpert" / "assets" / "tiny-qwen3-moe"
LAYERS = [f"model.layers.{i}.mlp.experts" for i in (0, 1)]
FORM = cpu_kernel_form(torch.bfloat16)
"""This machine's form (``vec`` or ``amx``)."""
OTHER_ISA = "vec" if FORM.isa == "amx" else "amx"


def pack_of(model: Path, out: Path, isa: str | None = None) -> ExpertPack:
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
        cpu_kernel_form(torch.bfloat16, isa),
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


def kernel_expert(layer: str, expert: int, isa: str | None = None) -> dict[str, torch.Tensor]:
    """The expert as vLLM's CPU kernel reads it: its own prepack op on the checkpoint's
    (the embedded model's intermediate size needs no padding)."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    return {
        key: cpu_prepack_moe_weight(t[None].contiguous(), isa or FORM.isa)[0]
        for key, t in checkpoint_expert(layer, expert).items()
    }


def read(pack: ExpertPack, layer: str, name: str, expert: int) -> torch.Tensor:
    """``expert``'s copy of tensor ``name``, as bytes."""
    tensor = next(t for t in pack.layers[layer].tensors if t.name == name)
    buffer = aligned_buffer(tensor.nbytes)
    file = DiskFile(pack.path / RECORDS_FILE)
    try:
        DiskReader(file, 2).submit(buffer, tensor.at(expert), tensor.nbytes).result()
    finally:
        file.close()
    return buffer[: tensor.nbytes]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def test_every_expert_reads_back_as_the_kernel_reads_it(pack):
    reader = DiskReader(DiskFile(pack.path / RECORDS_FILE), depth=4)
    print(f"O_DIRECT on {pack.path}: {reader.file.direct}; form: {pack.form.describe()}")
    assert pack.form == FORM
    jobs = []
    for name in LAYERS:
        layer = pack.layers[name]
        assert layer.num_experts == 64
        for tensor in layer.tensors:
            assert tensor.offset % ALIGN == 0
            for expert in range(layer.num_experts):
                buffer = aligned_buffer(tensor.nbytes)
                job = reader.submit(buffer, tensor.at(expert), tensor.nbytes)
                jobs.append((layer, tensor, expert, buffer, job))
    for layer, tensor, expert, buffer, job in jobs:
        job.result()
        pack.check_read(layer, tensor, expert, buffer.numpy().data)
        want = kernel_expert(layer.name, expert)[tensor.name]
        assert list(want.shape) == tensor.shape
        assert torch.equal(buffer, as_bytes(want))
        # (a prepack that did nothing would pass the line above with a wrong kernel form)
        assert not torch.equal(buffer, as_bytes(checkpoint_expert(layer.name, expert)[tensor.name]))
    assert reader.stats.reads == 2 * 128
    assert reader.stats.bytes == 128 * pack.layers[LAYERS[0]].expert_nbytes
    reader.close()


def test_a_changed_byte_is_caught_by_its_checksum(pack, tmp_path):
    copy = tmp_path / "pack"
    shutil.copytree(pack.path, copy)
    layer = pack.layers[LAYERS[1]]
    w2 = layer.tensors[1]
    with open(copy / RECORDS_FILE, "r+b") as f:
        f.seek(w2.at(5) + 1000)
        byte = f.read(1)
        f.seek(w2.at(5) + 1000)
        f.write(bytes([byte[0] ^ 0x10]))
    corrupted = ExpertPack(copy)  # the size is right: found when the tensor is read
    corrupted.check_read(layer, w2, 4, read(corrupted, LAYERS[1], w2.name, 4).numpy().data)
    with pytest.raises(CorruptRecord, match=r"model\.layers\.1\.mlp\.experts expert 5's w2_weight"):
        corrupted.check_read(layer, w2, 5, read(corrupted, LAYERS[1], w2.name, 5).numpy().data)


def test_records_exchanged_with_their_checksums_fail_as_the_other_expert(pack, tmp_path):
    # Experts 20 and 21 of every tensor of a layer exchanged, their checksums too (a
    # writer's offset off by one expert, or two records swapped by hand): each checksum
    # is seeded with its expert, so neither read passes as the other.
    copy = tmp_path / "pack"
    shutil.copytree(pack.path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    layer = pack.layers[LAYERS[1]]
    with open(copy / RECORDS_FILE, "r+b") as f:
        for tensor in layer.tensors:
            f.seek(tensor.at(20))
            both = f.read(2 * tensor.nbytes)
            f.seek(tensor.at(20))
            f.write(both[tensor.nbytes :] + both[: tensor.nbytes])
    for entry in manifest["layers"][1]["tensors"]:
        entry["xxh3"][20], entry["xxh3"][21] = entry["xxh3"][21], entry["xxh3"][20]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    exchanged = ExpertPack(copy, model=MODEL)
    for tensor in exchanged.layers[LAYERS[1]].tensors:
        for expert in (20, 21):
            data = read(exchanged, LAYERS[1], tensor.name, expert).numpy().data
            with pytest.raises(CorruptRecord, match=rf"expert {expert}'s {tensor.name}"):
                exchanged.check_read(exchanged.layers[LAYERS[1]], tensor, expert, data)
        # (the control: expert 19, untouched, passes)
        data = read(exchanged, LAYERS[1], tensor.name, 19).numpy().data
        exchanged.check_read(exchanged.layers[LAYERS[1]], tensor, 19, data)


def test_a_pack_of_an_older_format_is_refused_naming_the_fix(pack, tmp_path):
    copy = edited(pack, tmp_path, lambda m: m.update(format="specexpert-expert-pack/3"))
    with pytest.raises(SpecExpertConfigError) as error:
        ExpertPack(copy, model=MODEL)
    message = str(error.value)
    assert error.value.field_name == "disk.path" and "\n" not in message
    assert "specexpert-expert-pack/3" in message and f"remove {copy}" in message


def test_a_pack_of_another_isa_is_refused_naming_the_fix(tmp_path):
    other = pack_of(MODEL, tmp_path / "pack", isa=OTHER_ISA)
    # What it holds is the other ISA's order; where vLLM's build for this CPU orders it
    # unlike this machine's (an AMX-capable build), run it would compute wrongly.
    stored = read(other, LAYERS[0], "w13_weight", 3)
    assert torch.equal(stored, as_bytes(kernel_expert(LAYERS[0], 3, OTHER_ISA)["w13_weight"]))
    if torch.equal(stored, as_bytes(kernel_expert(LAYERS[0], 3)["w13_weight"])):
        print(
            f"vLLM's kernel build for this CPU prepacks {OTHER_ISA} as {FORM.isa}: the "
            "pack is refused by its form's name alone here"
        )
    with pytest.raises(SpecExpertConfigError) as error:
        prepare_pack(str(other.path), str(MODEL), FORM)
    message = str(error.value)
    assert error.value.field_name == "disk.path" and "\n" not in message
    assert f"CPU kernel's {OTHER_ISA} prepacked layout" in message
    assert f"reads the CPU kernel's {FORM.isa} prepacked layout" in message
    assert f"remove {other.path}" in message


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
    with pytest.raises(SpecExpertConfigError, match=r"--verify` found 1 experts unlike"):
        ExpertPack(pack.path, model=other)
    key = f"{LAYERS[0]}.0.down_proj.weight"
    tensors[key] = tensors[key][:, :32].contiguous()  # one shape changed
    save_file(tensors, str(other / "model.safetensors"))
    with pytest.raises(SpecExpertConfigError, match=r"disk\.path.*--verify` found"):
        ExpertPack(pack.path, model=other)
    (other / "model.safetensors").rename(other / "model-00001-of-00001.safetensors")
    with pytest.raises(SpecExpertConfigError, match=r"disk\.path.*another model"):
        ExpertPack(pack.path, model=other)


def edit_in_place(file: Path, key: str) -> None:
    """Flip the low bit of one byte of tensor ``key`` in the safetensors ``file`` where it
    is, keeping its inode, size and mtime (a second call flips it back)."""
    before = file.stat()
    with open(file, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        start, _ = json.loads(f.read(length))[key]["data_offsets"]
        f.seek(8 + length + start + 6)
        byte = f.read(1)[0]
        f.seek(8 + length + start + 6)
        f.write(bytes([byte ^ 0x01]))
    os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_pack_whose_verify_failed_is_refused_until_made_again_or_verified(pack, tmp_path, capsys):
    # The checkpoint edited in place where no sampled block looks, its mtime put back:
    # its files look as they did. --verify finds the expert; the next start refuses the
    # pack, until a --verify passes or the pack is made again.
    from vllm_specexpert.cli import main

    out = tmp_path / "pack"
    shutil.copytree(pack.path, out)
    model = tmp_path / "model"
    shutil.copytree(MODEL, model)
    main(["pack", str(model), "--out", str(out), "--verify"])  # (the copy, recorded)
    capsys.readouterr()
    key = f"{LAYERS[1]}.5.up_proj.weight"
    edit_in_place(model / "model.safetensors", key)
    assert checkpoint_files(model) == ExpertPack(out).manifest.checkpoint_files
    prepare_pack(str(out), str(model), FORM)  # (what the files show: unchanged)
    with pytest.raises(SystemExit):
        main(["pack", str(model), "--out", str(out), "--verify"])
    assert "511 of 512 experts match" in capsys.readouterr().out
    with pytest.raises(SpecExpertConfigError) as error:
        prepare_pack(str(out), str(model), FORM)
    assert error.value.field_name == "disk.path" and "\n" not in str(error.value)
    assert f"--out {out} --verify` found 1 experts unlike" in error.value.problem
    assert f"{LAYERS[1]} expert 5: w13_weight differs" in error.value.problem
    edit_in_place(model / "model.safetensors", key)  # as it was: verified
    main(["pack", str(model), "--out", str(out), "--verify"])
    prepare_pack(str(out), str(model), FORM)
    edit_in_place(model / "model.safetensors", key)  # again, and made anew
    with pytest.raises(SystemExit):
        main(["pack", str(model), "--out", str(out), "--verify"])
    main(["pack", str(model), "--out", str(out)])
    prepare_pack(str(out), str(model), FORM)


def test_a_manifest_too_deep_or_too_large_is_refused_in_one_line(pack, tmp_path, monkeypatch):
    from vllm_specexpert import artifacts

    copy = tmp_path / "pack"
    shutil.copytree(pack.path, copy)
    monkeypatch.setattr(artifacts, "MAX_MANIFEST_BYTES", 4096)  # (the real one: 64 MiB)
    with pytest.raises(SpecExpertConfigError, match=r"bytes, past the 0 MiB") as error:
        ExpertPack(copy, model=MODEL)
    assert error.value.field_name == "disk.path" and "\n" not in str(error.value)
    monkeypatch.undo()
    (copy / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(SpecExpertConfigError, match=r"nested deeper than") as error:
        ExpertPack(copy, model=MODEL)
    assert error.value.field_name == "disk.path" and "\n" not in str(error.value)


@pytest.mark.parametrize("kind", ["link to /dev/zero", "fifo", "directory"])
def test_a_manifest_that_is_not_a_regular_file_is_refused_before_it_is_read(
    pack, tmp_path, kind, capsys
):
    """Read, ``/dev/zero`` never ends and a FIFO never answers: both were read (the size
    limit takes a file's size, and theirs is 0), ``--verify`` until the memory ran out;
    at start a FIFO's pack was taken as unfinished and written again."""
    import signal

    from vllm_specexpert.calibration import load_calibration
    from vllm_specexpert.cli import main

    def not_a_file(manifest: Path) -> None:
        manifest.unlink()
        if kind == "fifo":
            os.mkfifo(manifest)
        elif kind == "directory":
            manifest.mkdir()
        else:
            manifest.symlink_to("/dev/zero")

    out = tmp_path / "pack"
    shutil.copytree(pack.path, out)
    not_a_file(out / "manifest.json")
    calibration = tmp_path / "calibration"
    shutil.copytree(MODEL.parent / "tiny-qwen3-moe-calibration", calibration)
    not_a_file(calibration / "manifest.json")
    signal.alarm(60)  # (a read that never ends fails the test, not the run)
    try:
        with pytest.raises(SpecExpertConfigError, match="is not a regular file") as error:
            prepare_pack(str(out), str(MODEL), FORM)
        assert error.value.field_name == "disk.path" and "\n" not in str(error.value)
        assert not (out / "experts.bin.partial").exists()  # (not taken as unfinished)
        with pytest.raises(SystemExit):
            main(["pack", str(MODEL), "--out", str(out), "--verify"])
        assert "is not a regular file" in capsys.readouterr().err
        with pytest.raises(SpecExpertConfigError, match="is not a regular file") as error:
            load_calibration(calibration)
        assert error.value.field_name == "calibration"
    finally:
        signal.alarm(0)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_lock_that_is_not_a_regular_file_is_refused_in_one_line(pack, tmp_path, kind):
    copy = tmp_path / "pack"
    shutil.copytree(pack.path, copy, ignore=shutil.ignore_patterns(".lock"))
    if kind == "directory":
        (copy / ".lock").mkdir()
    else:
        os.mkfifo(copy / ".lock")
    for start in (
        lambda: prepare_pack(str(copy), str(MODEL), FORM),
        lambda: open_disk(str(copy), str(MODEL), queue_depth=1, direct=False),
    ):
        with pytest.raises(
            SpecExpertConfigError, match=r"\.lock, the pack's lock, is not a"
        ) as error:
            start()
        assert error.value.field_name == "disk.path" and "\n" not in str(error.value)


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
    got = read(pack, LAYERS[0], "w2_weight", 7)
    assert torch.equal(got, as_bytes(kernel_expert(LAYERS[0], 7)["w2_weight"]))


def test_an_unaligned_read_goes_through_a_bounce_buffer_and_lands_exactly(pack):
    # (a biased expert's tensors, or memory not page-aligned: O_DIRECT cannot land there)
    tensor = pack.layers[LAYERS[0]].tensors[1]
    file = DiskFile(pack.path / RECORDS_FILE)
    print(f"O_DIRECT: {file.direct}")
    want = as_bytes(kernel_expert(LAYERS[0], 2)["w2_weight"])
    for skew, length in ((0, tensor.nbytes), (8, tensor.nbytes), (0, 1000), (64, 1000)):
        assert file.bounces(tensor.at(2), length, skew) == (
            file.direct and (skew or length % ALIGN) != 0
        )
        memory = aligned_buffer(tensor.nbytes + ALIGN)[skew : skew + length]
        file.read_into(memory, tensor.at(2), length)
        assert torch.equal(memory, want[:length])
        start = tensor.at(2) + 100  # an unaligned file offset too
        file.read_into(memory[: length - 100], start, length - 100)
        assert torch.equal(memory[: length - 100], want[100:length])
    file.close()


def test_a_read_past_the_end_of_the_file_is_an_error_not_zeros(pack):
    tensor = pack.manifest.layers[-1].tensors[-1]
    offset = tensor.at(pack.manifest.layers[-1].num_experts)  # one past the last expert
    file = DiskFile(pack.path / RECORDS_FILE)
    reader = DiskReader(file, 1)
    with pytest.raises(EOFError, match=r"ends at byte"):
        reader.submit(aligned_buffer(tensor.nbytes), offset, tensor.nbytes).result()
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


def edited(pack: ExpertPack, tmp_path: Path, edit) -> Path:
    """A copy of ``pack`` whose manifest ``edit(manifest dict)`` changed."""
    copy = tmp_path / "edited"
    shutil.copytree(pack.path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def tensor(manifest, name):
    return next(t for t in manifest["layers"][4]["tensors"] if t["name"] == name)


def w13(manifest, layer=4):
    return manifest["layers"][layer]["tensors"][0]


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda m: tensor(m, "w13_weight").update(dtype="float16"),
            "w13_weight is float16 .* the checkpoint's is bfloat16",
        ),
        (
            lambda m: m["layers"][4].update(num_experts=63),
            "64 checksums of w13_weight for 63 experts",
        ),
        (
            lambda m: m["layers"][4].update(num_experts=65),
            "64 checksums of w13_weight for 65 experts",
        ),
        (lambda m: tensor(m, "w2_weight")["xxh3"].pop(), "63 checksums of w2_weight for 64"),
        (
            lambda m: tensor(m, "w2_weight")["xxh3"].__setitem__(3, 2**70),
            "xxh3.3: Input should be less than 18446744073709551616",
        ),
        (
            lambda m: tensor(m, "w2_weight")["xxh3"].__setitem__(3, -1),
            "xxh3.3: Input should be greater than or equal to 0",
        ),
        (
            lambda m: w13(m).update(offset=w13(m)["offset"] - 4096),
            "records overlap the layer before",
        ),
        (
            lambda m: m["layers"][7]["tensors"][1].update(
                offset=m["layers"][7]["tensors"][1]["offset"] + 4096
            ),
            "records end at .*, past records_bytes",
        ),
        (
            lambda m: w13(m).update(offset=w13(m)["offset"] + 64),
            "w13_weight's offset is not 4096-aligned",
        ),
        (
            lambda m: tensor(m, "w2_weight").update(shape=[128, 64]),
            r"w2_weight is bfloat16 \[128, 64\] at byte \d+ .* is bfloat16 \[256, 64\]",
        ),
        (
            lambda m: tensor(m, "w2_weight").update(offset=w13(m)["offset"] + 4096),
            "tensor w2_weight overlaps the one before",
        ),
        (lambda m: m["layers"][4]["tensors"].pop(), "w2_weight is absent"),
        (lambda m: m["layers"].pop(), r"missing: \['model.layers.7.mlp.experts'\]"),
        (
            lambda m: m["layers"][4].update(name="model.layers.9.mlp.experts"),
            r"not in the checkpoint: \['model.layers.9.mlp.experts'\]",
        ),
        (
            lambda m: tensor(m, "w2_weight").update(dtype="complex64"),
            "tensors.1.dtype: Input should be 'bfloat16'",
        ),
        (lambda m: m["form"].update(isa="avx2"), "form.isa: Input should be 'vec' or 'amx'"),
        (
            lambda m: m["model_fingerprint"].update(router_sha256="0" * 64),
            r"made for another model \(differs in router_sha256",
        ),
        (lambda m: m.pop("form"), "key form: missing"),
    ],
    ids=[
        "dtype",
        "fewer_experts",
        "more_experts",
        "checksums",
        "checksum_past_64_bits",
        "negative_checksum",
        "offset",
        "last_offset",
        "unaligned",
        "shape",
        "tensor_offset",
        "missing_tensor",
        "missing_layer",
        "renamed_layer",
        "unknown_dtype",
        "unknown_isa",
        "router_fingerprint",
        "no_form",
    ],
)
def test_a_manifest_that_does_not_fit_the_model_is_refused_in_one_line(
    pack, tmp_path, edit, message
):
    copy = edited(pack, tmp_path, edit)
    with pytest.raises(SpecExpertConfigError, match=r"disk\.path") as error:
        ExpertPack(copy, model=MODEL)
    assert re.search(message, str(error.value)), str(error.value)
    assert "\n" not in str(error.value)


def test_an_unedited_copy_is_accepted(pack, tmp_path):
    # (the control of the cases above: the copy itself is not what they refuse)
    ExpertPack(edited(pack, tmp_path, lambda m: None), model=MODEL)


def test_a_pack_in_use_is_not_written_over_and_its_holder_is_named(pack, tmp_path, capsys):
    from vllm_specexpert.cli import main

    copy = tmp_path / "pack"
    shutil.copytree(pack.path, copy)
    disk = open_disk(str(copy), str(MODEL), queue_depth=1, direct=False)
    before = (copy / RECORDS_FILE).stat()
    with pytest.raises(SystemExit) as exit_:
        main(["pack", str(MODEL), "--out", str(copy)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"in use by pid {os.getpid()} (" in err and "--out" in err
    assert (copy / RECORDS_FILE).stat().st_ino == before.st_ino
    assert (copy / "manifest.json").exists()
    disk.close()  # the lock goes with the engine's disk
    main(["pack", str(MODEL), "--out", str(copy)])
    ExpertPack(copy, model=MODEL)


def test_an_engine_does_not_open_a_pack_being_written(tmp_path):
    out = tmp_path / "pack"
    out.mkdir()
    with (
        PackLock(out).hold(exclusive=True, wait=False),
        pytest.raises(SpecExpertConfigError, match=rf"disk\.path.*pid {os.getpid()}"),
    ):
        open_disk(str(out), str(MODEL), queue_depth=1, direct=False)


def test_two_starts_making_one_pack_write_it_once(tmp_path, monkeypatch):
    # The second start waits for the first's lock, then finds the pack whole and checks
    # it, instead of writing it again (or reading it half written).
    out = tmp_path / "pack"
    out.mkdir()
    waiting = threading.Event()
    real_info = pack_writer.logger.info

    def info(message, *args):
        if "waiting for" in message:
            waiting.set()
        real_info(message, *args)

    monkeypatch.setattr(pack_writer.logger, "info", info)
    writes = []
    real_pack = pack_writer._pack
    monkeypatch.setattr(pack_writer, "_pack", lambda *a: writes.append(a) or real_pack(*a))
    result: dict = {}
    with PackLock(out).hold(exclusive=True, wait=False):  # the first start, writing
        second = threading.Thread(
            target=lambda: result.update(pack=prepare_pack(str(out), str(MODEL), FORM))
        )
        second.start()
        assert waiting.wait(60), "the second start did not wait for the first"
        real_pack(MODEL, out, FORM, "disk.path", "disk", None)
    second.join(60)
    assert writes == [] and result["pack"].manifest.layers
    assert sorted(p.name for p in out.iterdir()) == [".lock", "experts.bin", "manifest.json"]


@pytest.mark.parametrize("leftover", ["records", "manifest", "both"])
def test_a_killed_write_is_recognised_and_written_over(tmp_path, capsys, leftover):
    from vllm_specexpert.cli import main

    for tool in ("pack", "start"):
        out = tmp_path / tool
        out.mkdir()
        (out / ".lock").touch()
        if leftover in ("records", "both"):
            (out / "experts.bin.partial").write_bytes(b"\0" * 8192)
        if leftover in ("manifest", "both"):
            (out / "manifest.json.partial").write_text("{")
        if tool == "pack":
            main(["pack", str(MODEL), "--out", str(out)])
        else:
            prepare_pack(str(out), str(MODEL), FORM)
        ExpertPack(out, model=MODEL)
        assert sorted(p.name for p in out.iterdir()) == [".lock", "experts.bin", "manifest.json"]


def failing_write(monkeypatch, error: int, after: int) -> None:
    """Writes to a pack's records fail with ``error`` once ``after`` bytes are written."""
    real_open = open
    written = [0]

    class Failing:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            written[0] += len(data)
            if written[0] > after:
                raise OSError(error, os.strerror(error))
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    def opener(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return Failing(f) if str(path).endswith(".partial") else f

    monkeypatch.setattr(pack_writer, "open", opener, raising=False)


def test_a_full_disk_during_a_write_is_one_error_and_leaves_no_partial_file(
    tmp_path, monkeypatch, capsys
):
    from vllm_specexpert.cli import main

    failing_write(monkeypatch, errno.ENOSPC, after=20 << 20)
    with pytest.raises(SystemExit) as exit_:
        main(["pack", str(MODEL), "--out", str(tmp_path / "pack")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "No space left on device" in err and "--out" in err
    usage_ends = next(i for i, line in enumerate(err.splitlines()) if "error:" in line)
    assert err.splitlines()[usage_ends:] == [err.splitlines()[-1]]
    assert sorted(p.name for p in (tmp_path / "pack").iterdir()) == [".lock"]
    with pytest.raises(SpecExpertConfigError, match=r"disk\.path.*No space left"):
        prepare_pack(str(tmp_path / "start"), str(MODEL), FORM)
    assert sorted(p.name for p in (tmp_path / "start").iterdir()) == [".lock"]


def test_a_read_only_filesystem_is_one_error_when_writing_and_no_obstacle_when_reading(
    pack, tmp_path, monkeypatch, capsys
):
    from vllm_specexpert.cli import main

    real_mkdir, real_open = Path.mkdir, os.open
    readonly = tmp_path / "ro"

    def mkdir(self, *args, **kwargs):
        if str(self).startswith(str(readonly)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kwargs)

    def open_(path, flags, *args):
        if str(path).startswith(str(readonly)) and flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(SystemExit) as exit_:
        main(["pack", str(MODEL), "--out", str(readonly / "pack")])
    assert exit_.value.code == 2 and "Read-only file system" in capsys.readouterr().err
    with pytest.raises(SpecExpertConfigError, match=r"disk\.path.*Read-only file system"):
        prepare_pack(str(readonly / "pack"), str(MODEL), FORM)
    # A pack made elsewhere and mounted read-only is read without a lock file: no
    # writer can change it there.
    monkeypatch.undo()
    shutil.copytree(pack.path, readonly, ignore=shutil.ignore_patterns(".lock"))
    monkeypatch.setattr(os, "open", open_)
    prepare_pack(str(readonly), str(MODEL), FORM)
    disk = open_disk(str(readonly), str(MODEL), queue_depth=1, direct=False)
    assert not (readonly / ".lock").exists()
    disk.close()
