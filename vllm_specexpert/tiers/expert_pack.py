"""The expert pack: every routed expert of a model in one expert-major file, each expert
one record at a 4 KiB-aligned offset, for whole-expert ``O_DIRECT`` reads
(:mod:`.disk_reader`). The disk tier reads experts from here.

A pack is a directory: ``experts.bin`` (the records) and ``manifest.json`` (written last:
a directory without it is an unfinished pack). The manifest says which model the pack
was made from (its fingerprint, and the size and header hash of every checkpoint file,
so that a checkpoint changed since is caught), and per MoE layer: where its records
start, the record size, each tensor's place, shape and dtype in a record, and each
record's CRC-32, checked when the record is first read.

A record holds one expert's tensors as the checkpoint stores them (``w13`` = gate and up
projections stacked, as vLLM's fused layout has them; ``w2`` = down), not in a kernel's
runtime layout: a pack is valid on every CPU, and what a kernel wants (the CPU build's
prepacked layout) is made on arrival, as for quantized experts (``ExpertDecoder``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from pydantic import BaseModel, NonNegativeInt, PositiveInt

from vllm_specexpert.artifacts import MANIFEST, MadeForModel, model_fingerprint, read_manifest
from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.tiers.checkpoint_experts import CheckpointExperts
from vllm_specexpert.tiers.disk_reader import ALIGN, aligned

PACK_FORMAT = "specexpert-expert-pack/1"
RECORDS_FILE = "experts.bin"
FIELD = "disk.path"
"""The config key a pack is named by in errors."""

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
"""Dtypes a record's tensors may have, by their name in the manifest."""


class PackTensor(BaseModel):
    model_config = MANIFEST

    name: str
    offset: NonNegativeInt
    """Byte offset within the record."""
    shape: list[NonNegativeInt]
    """One expert's shape."""
    dtype: str


class PackLayer(BaseModel):
    model_config = MANIFEST

    name: str
    """vLLM layer name, e.g. ``model.layers.3.mlp.experts``."""
    num_experts: PositiveInt
    offset: NonNegativeInt
    """Where the layer's first record starts in ``experts.bin`` (aligned)."""
    record_bytes: PositiveInt
    """Bytes of one record (aligned; the tensors' bytes and padding)."""
    tensors: list[PackTensor]
    crc32: list[NonNegativeInt]
    """Per expert, the CRC-32 of its tensors' bytes (without padding)."""

    def record(self, expert: int) -> tuple[int, int]:
        """``(offset, bytes with data)`` of ``expert``'s record."""
        return self.offset + expert * self.record_bytes, self.data_bytes

    @property
    def data_bytes(self) -> int:
        last = self.tensors[-1]
        return last.offset + _nbytes(last)


class CheckpointFile(BaseModel):
    model_config = MANIFEST

    name: str
    size: NonNegativeInt
    header_sha256: str
    sample_sha256: str
    """Hash of :data:`SAMPLES` blocks of the file's data, evenly spaced: a checkpoint
    rewritten with other values (a fine-tune of the same shapes) differs there."""


class PackManifest(MadeForModel):
    format: str
    checkpoint_files: list[CheckpointFile]
    layers: list[PackLayer]
    records_bytes: NonNegativeInt
    """Size of ``experts.bin``."""


def _nbytes(tensor: PackTensor) -> int:
    count = 1
    for n in tensor.shape:
        count *= n
    return count * DTYPES[tensor.dtype].itemsize


SAMPLES = 16
SAMPLE_BYTES = 64 << 10


def checkpoint_files(model_dir: str | Path) -> list[CheckpointFile]:
    """Each safetensors file of ``model_dir``: name, size, the hash of its header (the
    names, dtypes, shapes and offsets of its tensors) and of samples of its data (1 MiB
    read per file)."""
    files = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        size = path.stat().st_size
        samples = hashlib.sha256()
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = f.read(length)
            start = 8 + length
            for i in range(SAMPLES):
                f.seek(start + (size - start) * i // SAMPLES)
                samples.update(f.read(SAMPLE_BYTES))
        files.append(
            CheckpointFile(
                name=path.name,
                size=size,
                header_sha256=hashlib.sha256(header).hexdigest(),
                sample_sha256=samples.hexdigest(),
            )
        )
    return files


ExpertSource = Callable[[str, int], Mapping[str, torch.Tensor]]
"""``source(layer name, expert) -> tensor name -> one expert's tensor``."""


def write_pack(
    out: str | Path,
    layers: Iterable[tuple[str, int]],
    source: ExpertSource,
    made_for: Mapping[str, object],
) -> PackManifest:
    """Write a pack of ``layers`` (``(name, num_experts)``, in order) to the directory
    ``out``, one expert at a time from ``source`` (nothing but one record is held in
    memory). ``made_for``: the manifest's ``model``, ``model_fingerprint`` and
    ``checkpoint_files``. The manifest is written last; an existing one is removed first,
    so an interrupted write never leaves a pack that looks whole."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest_path.unlink(missing_ok=True)
    written: list[PackLayer] = []
    with open(out / RECORDS_FILE, "wb") as f:
        for name, num_experts in layers:
            layer: PackLayer | None = None
            for expert in range(num_experts):
                tensors = {k: t.contiguous() for k, t in source(name, expert).items()}
                if layer is None:
                    layer = _layer_of(name, num_experts, f.tell(), tensors)
                data = _record_bytes(name, expert, layer, tensors)
                layer.crc32.append(zlib.crc32(data))
                f.write(data)
                f.write(bytes(layer.record_bytes - len(data)))
            if layer is not None:
                written.append(layer)
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    manifest = PackManifest.model_validate(
        {**made_for, "format": PACK_FORMAT, "layers": written, "records_bytes": size}
    )
    manifest_path.write_text(json.dumps(manifest.model_dump(mode="json"), indent=1))
    return manifest


def _layer_of(
    name: str, num_experts: int, offset: int, tensors: Mapping[str, torch.Tensor]
) -> PackLayer:
    dtype_names = {dtype: key for key, dtype in DTYPES.items()}
    entries, at = [], 0
    for key, tensor in tensors.items():
        if tensor.dtype not in dtype_names:
            raise ValueError(f"{name}: tensor {key} has dtype {tensor.dtype}, not packable")
        entries.append(
            PackTensor(
                name=key, offset=at, shape=list(tensor.shape), dtype=dtype_names[tensor.dtype]
            )
        )
        at += aligned_to(tensor.numel() * tensor.element_size(), 64)
    return PackLayer(
        name=name,
        num_experts=num_experts,
        offset=offset,
        record_bytes=aligned(at),
        tensors=entries,
        crc32=[],
    )


def aligned_to(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


def _record_bytes(
    name: str, expert: int, layer: PackLayer, tensors: Mapping[str, torch.Tensor]
) -> bytes:
    """One expert's record without its final padding (tensors at their offsets)."""
    shapes = {t.name: (t.shape, t.dtype) for t in layer.tensors}
    found = {k: (list(t.shape), _dtype_name(t.dtype)) for k, t in tensors.items()}
    if found != shapes:
        raise ValueError(f"{name} expert {expert}: tensors {found}, the layer's are {shapes}")
    data = bytearray(layer.data_bytes)
    for entry in layer.tensors:
        raw = tensors[entry.name].view(torch.uint8).reshape(-1).numpy().tobytes()
        data[entry.offset : entry.offset + len(raw)] = raw
    return bytes(data)


def _dtype_name(dtype: torch.dtype) -> str:
    return next((k for k, v in DTYPES.items() if v == dtype), str(dtype))


class ExpertPack:
    """A pack opened for reading: its manifest checked, and its file's size."""

    def __init__(self, path: str | Path, model: str | Path | None = None) -> None:
        self.path = Path(path)
        fix = f"remove {self.path}: the plugin makes the pack again on the next start"
        self.manifest = read_manifest(
            self.path, FIELD, RECORDS_FILE, PACK_FORMAT, fix, PackManifest
        )
        self.layers = {layer.name: layer for layer in self.manifest.layers}
        size = (self.path / RECORDS_FILE).stat().st_size
        if size != self.manifest.records_bytes:
            raise SpecExpertConfigError(
                FIELD,
                f"{self.path / RECORDS_FILE} has {size} bytes, its manifest says "
                f"{self.manifest.records_bytes} (truncated or written over)",
                fix,
            )
        if model is not None:
            self.check_made_from(model, fix)

    def check_made_from(self, model: str | Path, fix: str) -> None:
        """Refuse a pack made from another checkpoint, or from this one before it
        changed (file names, sizes and headers compared)."""
        now = {f.name: f for f in checkpoint_files(model)}
        then = {f.name: f for f in self.manifest.checkpoint_files}
        if now.keys() != then.keys():
            raise SpecExpertConfigError(
                FIELD,
                f"{self.path} was made from checkpoint files {sorted(then)}, {model} has "
                f"{sorted(now)} (a pack of another model)",
                fix,
            )
        for name, file in now.items():
            if file != then[name]:
                raise SpecExpertConfigError(
                    FIELD,
                    f"{self.path} is out of date: {model}/{name} changed since the pack "
                    "was made (its size, tensor header or data differ)",
                    fix,
                )

    def unpack(self, layer: PackLayer, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """One record's tensors, as views of ``buffer`` (the record's bytes from its
        start)."""
        out = {}
        for entry in layer.tensors:
            nbytes = _nbytes(entry)
            raw = buffer[entry.offset : entry.offset + nbytes]
            out[entry.name] = raw.view(DTYPES[entry.dtype]).view(entry.shape)
        return out

    def check_record(self, layer: PackLayer, expert: int, buffer: torch.Tensor) -> None:
        """Raise ``CorruptRecord`` unless ``buffer`` holds ``expert``'s record as written
        (its CRC-32)."""
        data = buffer[: layer.data_bytes].numpy()
        if zlib.crc32(data.data) != layer.crc32[expert]:
            raise CorruptRecord(
                f"{self.path / RECORDS_FILE}: {layer.name} expert {expert} does not match "
                "its checksum (the file was changed or the disk returned bad data)"
            )


class CorruptRecord(OSError):
    """A record read from a pack is not what was written there."""


def pack_checkpoint(
    model: str | Path, target: str | Path, out_field: str = FIELD, model_field: str = "disk"
) -> PackManifest:
    """Write the pack of the checkpoint ``model`` to the directory ``target``: its MoE
    layers' experts, read and written one at a time. Refused before anything is written,
    with a config error naming ``model_field`` or ``out_field``, when the checkpoint
    cannot be read expert by expert or ``target``'s filesystem lacks the room (a pack
    already there counts as room: it is written over)."""
    target = Path(target)
    try:
        source = CheckpointExperts(model)
    except ValueError as error:
        raise SpecExpertConfigError(model_field, str(error), "give a bf16 checkpoint") from None
    layers = source.layers()
    if not layers:
        raise SpecExpertConfigError(
            model_field, f"{model}: no routed expert tensors found", "give an MoE checkpoint"
        )
    need = sum(count * aligned(source.expert_nbytes(name)) for name, count in layers)
    ancestor = target.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    records = target / RECORDS_FILE
    free = shutil.disk_usage(ancestor).free + (records.stat().st_size if records.exists() else 0)
    if need > free:
        raise SpecExpertConfigError(
            out_field,
            f"the pack of {model} needs {need / 1e9:.2f} GB, {ancestor} has "
            f"{free / 1e9:.2f} GB free",
            "give a directory on a disk with room",
        )
    return write_pack(
        target,
        layers,
        source,
        {
            "model": str(model),
            "model_fingerprint": model_fingerprint(model),
            "checkpoint_files": checkpoint_files(model),
        },
    )


__all__ = [
    "ALIGN",
    "CorruptRecord",
    "ExpertPack",
    "PackLayer",
    "checkpoint_files",
    "pack_checkpoint",
    "write_pack",
]
