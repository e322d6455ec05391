"""The expert pack: every routed expert of a model in one file, in the expert kernel's
form (:mod:`.kernel_form`), for whole-tensor reads that land where the kernel reads
(:mod:`.disk_reader`) or for mapping the file and running the kernel on its pages;
:mod:`.pack_writer` writes it.

A directory: ``experts.bin`` (the tensors), ``manifest.json`` (renamed into place last:
without it the pack is unfinished) and ``.lock`` (:mod:`.pack_lock`). Within a layer each
expert tensor has one region, 4 KiB-aligned, of every expert's copy of it back to back:
what the kernel takes as ``[num_experts, ...]``. The manifest names the checkpoint the
pack was made from, the form (a CPU pack is for one ISA) and, per layer and tensor, the
region and one xxh3-64 per expert, seeded with the layer, the expert and the tensor's
name (checked at every read; docs/design.md, "The disk tier": Trust).

A pack may also hold the ``lookahead`` draft's INT4 experts (``draft_layers``, after
every layer of the target, named as vLLM names the draft's layers:
:data:`DRAFT_PREFIX` and the target's name), in regions checked the same way.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Protocol

import torch
import xxhash
from pydantic import BaseModel, Field, NonNegativeInt, PositiveInt, Strict, model_validator

from vllm_specexpert.artifacts import MANIFEST, MadeForModel, check_matches_model, read_manifest
from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.tiers.checkpoint_experts import CheckpointExperts, TensorSpec
from vllm_specexpert.tiers.disk_reader import ALIGN, aligned
from vllm_specexpert.tiers.kernel_form import DTYPE_NAMES, DTYPES, DtypeName, KernelForm
from vllm_specexpert.tiers.store import ExpertsUnreadable

PACK_FORMAT = "specexpert-expert-pack/4"
"""/4: each checksum seeded with its expert's identity (:func:`checksum`); /3: the
kernel's form, a region per tensor; /2: the checkpoint's layout, a record per expert,
decoded on arrival."""
RECORDS_FILE = "experts.bin"
MANIFEST_FILE = "manifest.json"
FIELD = "disk.path"
"""The config key a pack is named by in errors."""
REMAKE = "remove {path}: the plugin makes the pack again on the next start"
DRAFT_PREFIX = "draft_model."
"""Prefix of the layer names of vLLM's draft model (``DraftModelProposer``): a pack's
draft layer is named by it and its target layer's name."""
Checksum = Annotated[int, Strict(), Field(ge=0, lt=1 << 64)]
"""An xxh3-64: a larger number is corruption, refused when the manifest is read."""


class PackTensor(BaseModel):
    """One expert tensor of a layer: its region in ``experts.bin``."""

    model_config = MANIFEST

    name: str
    offset: NonNegativeInt
    """Where expert 0's copy starts in ``experts.bin`` (aligned); expert ``e``'s is
    ``nbytes * e`` further."""
    shape: list[NonNegativeInt]
    """One expert's shape."""
    dtype: DtypeName
    xxh3: list[Checksum]
    """Per expert, the xxh3-64 of its copy, seeded with its identity (:func:`checksum`)."""

    @property
    def nbytes(self) -> int:
        """Bytes of one expert's copy."""
        count = 1
        for n in self.shape:
            count *= n
        return count * DTYPES[self.dtype].itemsize

    def at(self, expert: int) -> int:
        return self.offset + expert * self.nbytes


class PackLayer(BaseModel):
    model_config = MANIFEST

    name: str
    """vLLM layer name, e.g. ``model.layers.3.mlp.experts``."""
    num_experts: PositiveInt
    tensors: list[PackTensor]

    @model_validator(mode="after")
    def _extent(self) -> PackLayer:
        if not self.tensors:
            raise ValueError(f"{self.name}: no tensors")
        end = 0
        for tensor in self.tensors:
            if tensor.offset % ALIGN:
                raise ValueError(f"{self.name}: {tensor.name}'s offset is not {ALIGN}-aligned")
            if tensor.offset < end:
                raise ValueError(f"{self.name}: tensor {tensor.name} overlaps the one before")
            if len(tensor.xxh3) != self.num_experts:
                raise ValueError(
                    f"{self.name}: {len(tensor.xxh3)} checksums of {tensor.name} for "
                    f"{self.num_experts} experts"
                )
            end = tensor.offset + self.num_experts * tensor.nbytes
        return self

    @property
    def offset(self) -> int:
        return self.tensors[0].offset

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert (its tensors)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def end(self) -> int:
        """Where the next layer's regions may start (aligned)."""
        last = self.tensors[-1]
        return aligned(last.offset + self.num_experts * last.nbytes)


class CheckpointFile(BaseModel):
    model_config = MANIFEST

    name: str
    size: NonNegativeInt
    mtime_ns: NonNegativeInt
    inode: NonNegativeInt
    header_sha256: str
    sample_sha256: str
    """Hash of :data:`SAMPLES` blocks of the file's data, evenly spaced."""


class VerifyFailure(BaseModel):
    """What the last ``specexpert pack --verify`` found unlike the checkpoint: the pack is
    refused at start until it is made again or verified whole."""

    model_config = MANIFEST

    problems: PositiveInt
    first: str


class PackManifest(MadeForModel):
    format: str
    form: KernelForm
    checkpoint_files: list[CheckpointFile]
    layers: list[PackLayer]
    records_bytes: NonNegativeInt
    """Size of ``experts.bin``."""
    verify_failed: VerifyFailure | None = None
    draft_layers: list[PackLayer] = Field(default_factory=list)
    """The ``lookahead`` draft's INT4 experts, a layer per target layer, after them
    (``specexpert pack --draft``; none: a pack for the target alone)."""

    @model_validator(mode="after")
    def _extent(self) -> PackManifest:
        end, names = 0, set()
        for layer in [*self.layers, *self.draft_layers]:
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
    """The regions of a layer of ``num_experts`` experts of tensors ``specs`` from
    ``offset`` on, the one writer and reader share (without checksums)."""
    entries, at = [], offset
    for key, shape, dtype in specs:
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"{name}: tensor {key} has dtype {dtype}, not packable")
        entry = PackTensor(
            name=key, offset=at, shape=list(shape), dtype=DTYPE_NAMES[dtype], xxh3=[]
        )
        entries.append(entry)
        at = aligned(at + num_experts * entry.nbytes)
    return PackLayer.model_construct(name=name, num_experts=num_experts, tensors=entries)


def checksum(data: memoryview | bytes, layer: str, expert: int, tensor: str) -> int:
    """The xxh3-64 of ``data``, ``expert``'s copy of ``tensor`` in ``layer``, seeded with
    that identity: bytes that are another expert's (records exchanged, a writer's wrong
    offset) fail it even when their checksum was moved with them."""
    return xxhash.xxh3_64_intdigest(data, seed=identity_seed(layer, expert, tensor))


def identity_seed(layer: str, expert: int, tensor: str) -> int:
    return xxhash.xxh3_64_intdigest(f"{layer}\0{expert}\0{tensor}".encode())


class ExpertPack:
    """A pack opened for reading, checked (and, given ``model`` and ``form``, against that
    checkpoint and the form its kernel reads)."""

    def __init__(
        self, path: str | Path, model: str | Path | None = None, form: KernelForm | None = None
    ) -> None:
        self.path = Path(path)
        self.fix = REMAKE.format(path=self.path)
        self.manifest = read_manifest(
            self.path, FIELD, RECORDS_FILE, PACK_FORMAT, self.fix, PackManifest
        )
        self.layers = {
            layer.name: layer for layer in [*self.manifest.layers, *self.manifest.draft_layers]
        }
        """Every layer of the pack by name: the target's and the draft's."""
        size = (self.path / RECORDS_FILE).stat().st_size
        if size != self.manifest.records_bytes:
            raise self._error(
                f"{self.path / RECORDS_FILE} has {size} bytes, its manifest says "
                f"{self.manifest.records_bytes} (truncated or written over)"
            )
        if form is not None:
            self.check_form(form)
        if model is not None:
            self.check_made_from(model)

    @property
    def form(self) -> KernelForm:
        return self.manifest.form

    @property
    def has_draft(self) -> bool:
        """The pack holds the ``lookahead`` draft's experts."""
        return bool(self.manifest.draft_layers)

    def check_form(self, form: KernelForm) -> None:
        """Refuse a pack whose experts are not in ``form`` (made for another ISA, dtype or
        kernel): the kernel would compute on them wrongly."""
        if self.form != form:
            raise self._error(
                f"{self.path} holds experts in {self.form.describe()}; this machine's "
                f"expert kernel reads {form.describe()} (a pack made on another machine, "
                "or for another dtype)"
            )

    def _error(self, problem: str) -> SpecExpertConfigError:
        return SpecExpertConfigError(FIELD, problem, self.fix)

    def check_made_from(self, model: str | Path) -> None:
        """Refuse a pack made from another checkpoint or from this one before it changed
        (its files, or its routers' fingerprint), whose layout is not what this
        checkpoint's experts make, or that ``--verify`` found unlike the checkpoint."""
        now = {f.name: f for f in checkpoint_files(model)}
        then = {f.name: f for f in self.manifest.checkpoint_files}
        if now.keys() != then.keys():
            raise self._error(
                f"{self.path} was made from checkpoint files {sorted(then)}, {model} has "
                f"{sorted(now)} (a pack of another model)"
            )
        verify = f"`specexpert pack {model} --out {self.path} --verify`"
        failed = self.manifest.verify_failed
        if failed is not None:
            raise SpecExpertConfigError(
                FIELD,
                f"{verify} found {failed.problems} experts unlike the checkpoint's (first: "
                f"{failed.first})",
                "make the pack again (`specexpert pack MODEL --out DIR`, or remove the "
                "directory: the next start makes it), or verify it again once the "
                "checkpoint is as it was",
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
                    f"{verify} compares every expert and, if all match, records the "
                    "checkpoint as it is now; or " + self.fix,
                )
        check_matches_model(self.manifest, str(model), field=FIELD, fix=self.fix)
        self.check_layout(CheckpointExperts(model))

    def check_layout(self, source: CheckpointExperts) -> None:
        """Every MoE layer of ``source``, its expert count and its records' layout as
        this pack's manifest has them, and nothing else."""
        expected, offset = [], 0
        for name, count in source.layers():
            specs = self.form.specs(source.tensor_specs(name))
            layer = layer_layout(name, count, offset, specs)
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
            for key in ("num_experts", "offset"):
                if getattr(have, key) != getattr(want, key):
                    raise self._error(
                        f"{self.path}: {want.name}'s {key} is {getattr(have, key)} in the "
                        f"manifest, the checkpoint's experts make {getattr(want, key)}"
                    )
            have_tensors = {t.name: t for t in have.tensors}
            for tensor in want.tensors:
                found = have_tensors.pop(tensor.name, None)
                if found is None or found.model_dump(exclude={"xxh3"}) != tensor.model_dump(
                    exclude={"xxh3"}
                ):
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
        drafts = [(d.name, d.num_experts) for d in self.manifest.draft_layers]
        if drafts and drafts != [(DRAFT_PREFIX + t.name, t.num_experts) for t in expected]:
            raise self._error(
                f"{self.path}: its draft layers are not the checkpoint's MoE layers "
                f"(first: {drafts[0][0]})"
            )

    def unreadable(self, layer: str, causes: dict[int, str]) -> ExpertsUnreadable:
        """Experts of ``layer`` could not be read from this pack (each its cause)."""
        return ExpertsUnreadable(
            layer,
            causes,
            FIELD,
            f"`specexpert pack MODEL --out {self.path} --verify` names every expert that "
            f"differs from the checkpoint; or {self.fix}",
        )

    def check_read(
        self, layer: PackLayer, tensor: PackTensor, expert: int, data: memoryview
    ) -> None:
        """Raise :class:`CorruptRecord` unless ``data`` (``expert``'s copy of ``tensor``,
        as read) has its checksum."""
        if checksum(data, layer.name, expert, tensor.name) != tensor.xxh3[expert]:
            raise CorruptRecord(
                f"{self.path / RECORDS_FILE}: {layer.name} expert {expert}'s {tensor.name} "
                "does not match its checksum (the file was changed or the disk returned bad data)"
            )

    def verify(self, source: CheckpointExperts, draft: DraftForm | None = None) -> list[str]:
        """Compare every expert with ``source``'s, in this pack's form, and the draft's
        (given its ``draft`` form) with ``source``'s in that form; what is wrong (empty:
        all good)."""
        problems = []
        forms: list[tuple[PackLayer, Callable[[str, int], Mapping[str, torch.Tensor]]]] = [
            (layer, lambda name, e: self.form(source(name, e))) for layer in self.manifest.layers
        ]
        if draft is not None:
            forms += [
                (layer, lambda name, e: draft(source(name.removeprefix(DRAFT_PREFIX), e)))
                for layer in self.manifest.draft_layers
            ]
        with open(self.path / RECORDS_FILE, "rb", buffering=0) as f:
            for layer, form in forms:
                for expert in range(layer.num_experts):
                    want = form(layer.name, expert)
                    for tensor in layer.tensors:
                        buffer = torch.empty(tensor.nbytes, dtype=torch.uint8)
                        f.seek(tensor.at(expert))
                        f.readinto(buffer.numpy().data)
                        try:
                            self.check_read(layer, tensor, expert, buffer.numpy().data)
                        except CorruptRecord as corrupt:
                            problems.append(str(corrupt))
                            continue
                        if not torch.equal(buffer, _bytes(want[tensor.name])):
                            problems.append(
                                f"{layer.name} expert {expert}: {tensor.name} differs from the "
                                "checkpoint's"
                            )
        return problems


def _described(tensor: PackTensor) -> str:
    return f"{tensor.dtype} {tensor.shape} at byte {tensor.offset}"


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8).reshape(-1)


class DraftForm(Protocol):
    """The ``lookahead`` draft's form of an expert (INT4), as a pack's draft regions
    hold it: what ``specexpert pack --draft`` writes and ``--verify`` checks."""

    def specs(self, specs: Sequence[TensorSpec]) -> list[TensorSpec]:
        """The shapes and dtypes of one expert of the checkpoint's ``specs`` in this form."""
        ...

    def __call__(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One expert (the checkpoint's tensors) in this form."""
        ...


class CorruptRecord(OSError):
    """An expert tensor read from a pack is not what was written there."""


__all__ = [
    "ALIGN",
    "DRAFT_PREFIX",
    "CorruptRecord",
    "DraftForm",
    "ExpertPack",
    "PackLayer",
    "PackTensor",
    "checkpoint_files",
    "checksum",
    "layer_layout",
]
