"""The expert pack: every routed expert of a model in one expert-major file, each expert
one record at a 4 KiB-aligned offset, for whole-expert ``O_DIRECT`` reads
(:mod:`.disk_reader`); :mod:`.pack_writer` writes it.

A directory: ``experts.bin`` (the records), ``manifest.json`` (renamed into place last:
without it the pack is unfinished) and ``.lock`` (:mod:`.pack_lock`). The manifest names
the checkpoint it was made from and, per layer, the records' layout and xxh3-64s
(checked at every read). Records hold the checkpoint's layout, not a kernel's, so a pack
is valid on every CPU (docs/design.md, "The disk tier").
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch
import xxhash
from pydantic import BaseModel, NonNegativeInt, PositiveInt, model_validator

from vllm_specexpert.artifacts import MANIFEST, MadeForModel, read_manifest
from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.tiers.checkpoint_experts import CheckpointExperts, TensorSpec
from vllm_specexpert.tiers.disk_reader import ALIGN, aligned

PACK_FORMAT = "specexpert-expert-pack/2"
"""/2: an xxh3-64 per record, checked at every read (/1 had a CRC-32 checked once)."""
RECORDS_FILE = "experts.bin"
MANIFEST_FILE = "manifest.json"
FIELD = "disk.path"
"""The config key a pack is named by in errors."""
REMAKE = "remove {path}: the plugin makes the pack again on the next start"

DtypeName = Literal["bfloat16", "float16", "float32", "int32", "uint8", "int8", "float8_e4m3fn"]
DTYPES: dict[DtypeName, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
"""Dtypes a record's tensors may have, by their name in the manifest."""
TENSOR_ALIGN = 64
"""Alignment of each tensor within a record (a cache line)."""


class PackTensor(BaseModel):
    model_config = MANIFEST

    name: str
    offset: NonNegativeInt
    """Byte offset within the record."""
    shape: list[NonNegativeInt]
    """One expert's shape."""
    dtype: DtypeName

    @property
    def nbytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count * DTYPES[self.dtype].itemsize


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
    xxh3: list[NonNegativeInt]
    """Per expert, the xxh3-64 of its record's data (without the final padding)."""

    @model_validator(mode="after")
    def _extent(self) -> PackLayer:
        if self.offset % ALIGN or self.record_bytes % ALIGN:
            raise ValueError(f"{self.name}: offset and record_bytes must be multiples of {ALIGN}")
        if not self.tensors:
            raise ValueError(f"{self.name}: no tensors")
        end = 0
        for tensor in self.tensors:
            if tensor.offset < end:
                raise ValueError(f"{self.name}: tensor {tensor.name} overlaps the one before")
            end = tensor.offset + tensor.nbytes
        if end > self.record_bytes:
            raise ValueError(f"{self.name}: tensors end at {end}, past record_bytes")
        if len(self.xxh3) != self.num_experts:
            raise ValueError(
                f"{self.name}: {len(self.xxh3)} checksums for {self.num_experts} experts"
            )
        return self

    def record(self, expert: int) -> tuple[int, int]:
        """``(offset, bytes with data)`` of ``expert``'s record."""
        return self.offset + expert * self.record_bytes, self.data_bytes

    @property
    def data_bytes(self) -> int:
        last = self.tensors[-1]
        return last.offset + last.nbytes

    @property
    def end(self) -> int:
        return self.offset + self.num_experts * self.record_bytes


class CheckpointFile(BaseModel):
    model_config = MANIFEST

    name: str
    size: NonNegativeInt
    mtime_ns: NonNegativeInt
    inode: NonNegativeInt
    header_sha256: str
    sample_sha256: str
    """Hash of :data:`SAMPLES` blocks of the file's data, evenly spaced."""


class PackManifest(MadeForModel):
    format: str
    checkpoint_files: list[CheckpointFile]
    layers: list[PackLayer]
    records_bytes: NonNegativeInt
    """Size of ``experts.bin``."""

    @model_validator(mode="after")
    def _extent(self) -> PackManifest:
        end, names = 0, set()
        for layer in self.layers:
            if layer.name in names:
                raise ValueError(f"layer {layer.name} appears twice")
            names.add(layer.name)
            if layer.offset < end:
                raise ValueError(f"{layer.name}: records overlap the layer before")
            end = layer.end
        if end > self.records_bytes:
            raise ValueError(f"the records end at {end}, past records_bytes")
        return self


SAMPLES = 16
SAMPLE_BYTES = 64 << 10


def checkpoint_files(model_dir: str | Path) -> list[CheckpointFile]:
    """Each safetensors file of ``model_dir``: size, mtime, inode, header hash and a hash
    of sampled data (1 MiB read per file)."""
    files = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        stat = path.stat()
        samples = hashlib.sha256()
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = f.read(length)
            start = 8 + length
            for i in range(SAMPLES):
                f.seek(start + (stat.st_size - start) * i // SAMPLES)
                samples.update(f.read(SAMPLE_BYTES))
        files.append(
            CheckpointFile(
                name=path.name,
                size=stat.st_size,
                mtime_ns=stat.st_mtime_ns,
                inode=stat.st_ino,
                header_sha256=hashlib.sha256(header).hexdigest(),
                sample_sha256=samples.hexdigest(),
            )
        )
    return files


def layer_layout(
    name: str, num_experts: int, offset: int, specs: Sequence[TensorSpec]
) -> PackLayer:
    """The record layout of ``specs`` (``(name, shape, dtype)``), the one writer and reader
    share (without checksums)."""
    dtype_names = {dtype: key for key, dtype in DTYPES.items()}
    entries, at = [], 0
    for key, shape, dtype in specs:
        if dtype not in dtype_names:
            raise ValueError(f"{name}: tensor {key} has dtype {dtype}, not packable")
        entry = PackTensor(name=key, offset=at, shape=list(shape), dtype=dtype_names[dtype])
        entries.append(entry)
        at += -(-entry.nbytes // TENSOR_ALIGN) * TENSOR_ALIGN
    return PackLayer.model_construct(
        name=name,
        num_experts=num_experts,
        offset=offset,
        record_bytes=aligned(at),
        tensors=entries,
        xxh3=[],
    )


def checksum(data: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


class ExpertPack:
    """A pack opened for reading, checked (and, given ``model``, against that checkpoint)."""

    def __init__(self, path: str | Path, model: str | Path | None = None) -> None:
        self.path = Path(path)
        self.fix = REMAKE.format(path=self.path)
        self.manifest = read_manifest(
            self.path, FIELD, RECORDS_FILE, PACK_FORMAT, self.fix, PackManifest
        )
        self.layers = {layer.name: layer for layer in self.manifest.layers}
        size = (self.path / RECORDS_FILE).stat().st_size
        if size != self.manifest.records_bytes:
            raise self._error(
                f"{self.path / RECORDS_FILE} has {size} bytes, its manifest says "
                f"{self.manifest.records_bytes} (truncated or written over)"
            )
        if model is not None:
            self.check_made_from(model)

    def _error(self, problem: str) -> SpecExpertConfigError:
        return SpecExpertConfigError(FIELD, problem, self.fix)

    def check_made_from(self, model: str | Path) -> None:
        """Refuse a pack made from another checkpoint or from this one before it changed,
        or whose layout is not what this checkpoint's experts make."""
        now = {f.name: f for f in checkpoint_files(model)}
        then = {f.name: f for f in self.manifest.checkpoint_files}
        if now.keys() != then.keys():
            raise self._error(
                f"{self.path} was made from checkpoint files {sorted(then)}, {model} has "
                f"{sorted(now)} (a pack of another model)"
            )
        for name, file in now.items():
            changed = [
                key for key, value in file.model_dump().items() if getattr(then[name], key) != value
            ]
            if changed:
                verb = "differ" if len(changed) > 1 else "differs"
                raise SpecExpertConfigError(
                    FIELD,
                    f"{self.path} is out of date: {model}/{name} changed since the pack was "
                    f"made (its {', '.join(changed)} {verb})",
                    f"`specexpert pack {model} --out {self.path} --verify` compares every "
                    "expert and, if all match, records the checkpoint as it is now; or " + self.fix,
                )
        self.check_layout(CheckpointExperts(model))

    def check_layout(self, source: CheckpointExperts) -> None:
        """Every MoE layer of ``source``, its expert count and its records' layout as
        this pack's manifest has them, and nothing else."""
        expected, offset = [], 0
        for name, count in source.layers():
            layer = layer_layout(name, count, offset, source.tensor_specs(name))
            expected.append(layer)
            offset = layer.end
        have_names = [layer.name for layer in self.manifest.layers]
        want_names = [layer.name for layer in expected]
        if have_names != want_names:
            extra = sorted(set(have_names) - set(want_names))
            missing = sorted(set(want_names) - set(have_names))
            raise self._error(
                f"{self.path} does not hold the checkpoint's MoE layers (missing: "
                f"{missing[:3] or 'none'}; not in the checkpoint: {extra[:3] or 'none'})"
            )
        for want in expected:
            have = self.layers[want.name]
            for key in ("num_experts", "offset", "record_bytes"):
                if getattr(have, key) != getattr(want, key):
                    raise self._error(
                        f"{self.path}: {want.name}'s {key} is {getattr(have, key)} in the "
                        f"manifest, the checkpoint's experts make {getattr(want, key)}"
                    )
            have_tensors = {t.name: t for t in have.tensors}
            for tensor in want.tensors:
                found = have_tensors.pop(tensor.name, None)
                if found != tensor:
                    got = "absent" if found is None else _described(found)
                    raise self._error(
                        f"{self.path}: {want.name}'s tensor {tensor.name} is {got} in the "
                        f"manifest, the checkpoint's is {_described(tensor)}"
                    )
            if have_tensors:
                raise self._error(
                    f"{self.path}: {want.name} has tensors the checkpoint's experts do not "
                    f"({', '.join(have_tensors)})"
                )

    def unpack(self, layer: PackLayer, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """One record's tensors, as views of ``buffer``."""
        out = {}
        for entry in layer.tensors:
            raw = buffer[entry.offset : entry.offset + entry.nbytes]
            out[entry.name] = raw.view(DTYPES[entry.dtype]).view(entry.shape)
        return out

    def check_record(self, layer: PackLayer, expert: int, buffer: torch.Tensor) -> None:
        """Raise :class:`CorruptRecord` unless ``buffer``'s checksum is ``expert``'s."""
        if checksum(buffer[: layer.data_bytes].numpy().data) != layer.xxh3[expert]:
            raise CorruptRecord(
                f"{self.path / RECORDS_FILE}: {layer.name} expert {expert} does not match "
                "its checksum (the file was changed or the disk returned bad data)"
            )

    def verify(self, source: CheckpointExperts) -> list[str]:
        """Compare every record with ``source``'s expert; what is wrong (empty: all good)."""
        problems = []
        with open(self.path / RECORDS_FILE, "rb", buffering=0) as f:
            for layer in self.manifest.layers:
                buffer = torch.empty(layer.data_bytes, dtype=torch.uint8)
                for expert in range(layer.num_experts):
                    f.seek(layer.record(expert)[0])
                    f.readinto(buffer.numpy().data)
                    try:
                        self.check_record(layer, expert, buffer)
                    except CorruptRecord as corrupt:
                        problems.append(str(corrupt))
                        continue
                    stored = self.unpack(layer, buffer)
                    for name, tensor in source(layer.name, expert).items():
                        if not torch.equal(stored[name].view(torch.uint8), _bytes(tensor)):
                            problems.append(
                                f"{layer.name} expert {expert}: {name} differs from the "
                                "checkpoint's"
                            )
        return problems


def _described(tensor: PackTensor) -> str:
    return f"{tensor.dtype} {tensor.shape} at byte {tensor.offset}"


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


class CorruptRecord(OSError):
    """A record read from a pack is not what was written there."""


__all__ = [
    "ALIGN",
    "CorruptRecord",
    "ExpertPack",
    "PackLayer",
    "checkpoint_files",
    "checksum",
    "layer_layout",
]
