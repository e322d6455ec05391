"""Writing an expert pack (:mod:`.expert_pack`): by ``specexpert pack``, or by the first
engine start that finds none. Holding the lock alone, to ``*.partial`` files, fsynced and
renamed, the manifest last; a failed write removes them, a killed one leaves only pack
file names the next writer writes over (docs/design.md, "The disk tier": Trust).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import torch

from vllm_specexpert.artifacts import model_fingerprint
from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.log import init_logger
from vllm_specexpert.tiers.checkpoint_experts import CheckpointExperts
from vllm_specexpert.tiers.expert_pack import (
    DRAFT_PREFIX,
    FIELD,
    MANIFEST_FILE,
    PACK_FORMAT,
    RECORDS_FILE,
    DraftForm,
    ExpertPack,
    PackLayer,
    PackManifest,
    checkpoint_files,
    checksum,
    layer_layout,
)
from vllm_specexpert.tiers.kernel_form import DTYPE_NAMES, KernelForm
from vllm_specexpert.tiers.pack_lock import LOCK_FILE, NotALockFile, PackBusy, PackLock

logger = init_logger(__name__)

PARTIAL = ".partial"
OWN_FILES = frozenset(
    {RECORDS_FILE, MANIFEST_FILE, LOCK_FILE, RECORDS_FILE + PARTIAL, MANIFEST_FILE + PARTIAL}
)
"""Every file a pack directory may hold, finished or not."""

PackSource = Callable[[str, int], Mapping[str, torch.Tensor]]
"""``source(layer name, expert) -> tensor name -> one expert's tensor`` (the checkpoint's
layout: the writer puts it in the pack's form)."""


def is_pack_dir(path: Path) -> bool:
    """``path`` holds only a pack's files (maybe interrupted): a writer may write it over."""
    return all(p.name in OWN_FILES for p in path.iterdir())


def write_pack(
    out: str | Path,
    layers: Sequence[tuple[str, int]],
    source: PackSource,
    made_for: Mapping[str, object],
    form: KernelForm,
    draft: DraftForm | None = None,
) -> PackManifest:
    """Write a pack of ``layers`` (``(name, num_experts)``) in ``form`` to ``out`` (lock
    held), one expert at a time, and with a ``draft`` form the draft's layers after
    them; ``made_for``: the manifest's model fields. On ``OSError`` the partial files
    are removed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / MANIFEST_FILE
    manifest_path.unlink(missing_ok=True)  # (a pack being rewritten is never whole)
    records = out / (RECORDS_FILE + PARTIAL)
    try:
        with open(records, "wb") as f:
            written, size = _write_records(f, layers, lambda n, e: form(source(n, e)), 0)
            drafts: list[PackLayer] = []
            if draft is not None:  # (the checkpoint read again: one expert in memory)
                drafted = [(DRAFT_PREFIX + name, count) for name, count in layers]
                drafts, size = _write_records(
                    f, drafted, lambda n, e: draft(source(n.removeprefix(DRAFT_PREFIX), e)), size
                )
            f.truncate(size)  # (the last region's alignment padding)
            f.flush()
            os.fsync(f.fileno())
        manifest = PackManifest.model_validate(
            {
                **made_for,
                "format": PACK_FORMAT,
                "form": form,
                "layers": written,
                "draft_layers": drafts,
                "records_bytes": size,
            }
        )
        os.replace(records, out / RECORDS_FILE)
        write_manifest(out, manifest)
    except BaseException:
        records.unlink(missing_ok=True)
        raise
    return manifest


def write_manifest(out: Path, manifest: PackManifest) -> None:
    """``manifest.json`` of the pack ``out``, replaced whole or not at all."""
    staged = out / (MANIFEST_FILE + PARTIAL)
    try:
        with open(staged, "w") as f:
            f.write(json.dumps(manifest.model_dump(mode="json"), indent=1))
            f.flush()
            os.fsync(f.fileno())
        os.replace(staged, out / MANIFEST_FILE)
        _fsync_dir(out)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise


def verify_pack(
    path: str | Path, model: str | Path, form: KernelForm, draft: DraftForm | None = None
) -> tuple[ExpertPack, list[str]]:
    """:meth:`~.expert_pack.ExpertPack.verify` holding the pack alone; when all match,
    record the checkpoint's files as they are now (so a copied or touched checkpoint is
    accepted); else record the failure, which an engine's start then refuses until the
    pack is made again or verified whole. Returns the pack and what differs."""
    target = Path(path)
    with _writing(target, FIELD), PackLock(target).hold(exclusive=True, wait=False):
        pack = ExpertPack(target, form=form)
        source = CheckpointExperts(model)
        pack.check_layout(source)
        problems = pack.verify(source, draft if pack.has_draft else None)
        now = pack.manifest.model_dump(mode="json")
        if problems:
            now["verify_failed"] = {"problems": len(problems), "first": problems[0]}
        else:
            now.update(
                checkpoint_files=checkpoint_files(model),
                model_fingerprint=model_fingerprint(model),
                verify_failed=None,
            )
        write_manifest(target, PackManifest.model_validate(now))
    return pack, problems


def _write_records(
    f: BinaryIO, layers: Iterable[tuple[str, int]], source: PackSource, offset: int
) -> tuple[list[PackLayer], int]:
    """Write ``layers``' experts as ``source`` gives them (in the pack's form) from
    ``offset`` on; their regions and where the next may start."""
    written: list[PackLayer] = []
    for name, num_experts in layers:
        layer: PackLayer | None = None
        for expert in range(num_experts):
            tensors = source(name, expert)
            if layer is None:
                specs = [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
                layer = layer_layout(name, num_experts, offset, specs)
            _check_shapes(name, expert, layer, tensors)
            for entry in layer.tensors:
                data = tensors[entry.name].view(torch.uint8).reshape(-1).numpy().data
                entry.xxh3.append(checksum(data, name, expert, entry.name))
                f.seek(entry.at(expert))
                f.write(data)
        if layer is not None:
            written.append(PackLayer.model_validate(layer.model_dump()))
            offset = layer.end
    return written, offset


def _check_shapes(
    name: str, expert: int, layer: PackLayer, tensors: Mapping[str, torch.Tensor]
) -> None:
    want = {t.name: (t.shape, t.dtype) for t in layer.tensors}
    found = {k: (list(t.shape), DTYPE_NAMES.get(t.dtype)) for k, t in tensors.items()}
    if found != want:
        raise ValueError(f"{name} expert {expert}: tensors {found}, the layer's are {want}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pack_checkpoint(
    model: str | Path,
    target: str | Path,
    form: KernelForm,
    out_field: str = FIELD,
    model_field: str = "disk",
    draft: DraftForm | None = None,
) -> PackManifest:
    """Write ``model``'s pack in ``form`` (and its draft's experts in the ``draft``
    form) to ``target`` holding its lock alone (no waiting:
    :class:`~.pack_lock.PackBusy`). Refusals (unreadable checkpoint, too little room,
    unwritable directory) are config errors naming ``model_field`` or ``out_field``."""
    target = Path(target)
    with _writing(target, out_field), PackLock(target).hold(exclusive=True, wait=False):
        return _pack(model, target, form, out_field, model_field, draft)


def _pack(
    model: str | Path,
    target: Path,
    form: KernelForm,
    out_field: str,
    model_field: str,
    draft: DraftForm | None,
) -> PackManifest:
    try:
        source = CheckpointExperts(model)
    except ValueError as error:
        raise SpecExpertConfigError(model_field, str(error), "give a bf16 checkpoint") from None
    layers = source.layers()
    if not layers:
        raise SpecExpertConfigError(
            model_field, f"{model}: no routed expert tensors found", "give an MoE checkpoint"
        )
    need = 0
    for name, count in layers:
        need = layer_layout(name, count, need, form.specs(source.tensor_specs(name))).end
    if draft is not None:
        for name, count in layers:
            need = layer_layout(name, count, need, draft.specs(source.tensor_specs(name))).end
    old = [target / RECORDS_FILE, target / (RECORDS_FILE + PARTIAL)]
    free = shutil.disk_usage(target).free + sum(p.stat().st_size for p in old if p.exists())
    if need > free:
        raise SpecExpertConfigError(
            out_field,
            f"the pack of {model} needs {need / 1e9:.2f} GB, {target} has {free / 1e9:.2f} GB free",
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
        form,
        draft,
    )


@contextmanager
def _writing(target: Path, field: str) -> Iterator[None]:
    """Makes ``target``; an ``OSError`` writing there becomes a config error naming ``field``."""
    if target.exists() and not target.is_dir():
        raise SpecExpertConfigError(field, f"{target} is not a directory", "give a directory")
    try:
        target.mkdir(parents=True, exist_ok=True)
        yield
    except PackBusy:
        raise
    except OSError as error:
        raise SpecExpertConfigError(
            field,
            f"cannot write the expert pack to {target}: {error.strerror or error}",
            "give a directory on a writable filesystem with room for the pack, or make the "
            "pack ahead where it can be written (`specexpert pack MODEL --out DIR`)",
        ) from None


def prepare_pack(
    path: str, model: str, form: KernelForm, draft: DraftForm | None = None
) -> ExpertPack:
    """The pack at ``path`` for ``model`` in ``form``, with the ``lookahead`` draft's
    experts given their ``draft`` form: checked if whole, else made. Runs where the
    engine config is built, before any worker; waits for another process writing it."""
    target = Path(path)
    if not Path(model, "config.json").is_file():
        raise SpecExpertConfigError(
            "disk", f"the checkpoint {model} is not a local directory", "give its local path"
        )
    if target.exists() and not target.is_dir():
        raise SpecExpertConfigError(FIELD, f"{target} is not a directory", "give a directory")
    if target.is_dir() and not is_pack_dir(target):
        others = sorted(p.name for p in target.iterdir() if p.name not in OWN_FILES)
        raise SpecExpertConfigError(
            FIELD,
            f"{target} holds other things than an expert pack ({', '.join(others[:3])})",
            "give a new or empty directory",
        )
    if (target / MANIFEST_FILE).exists():  # (not a regular file: refused on reading it)
        with _waiting(target, exclusive=False):
            return _with_draft(ExpertPack(target, model=model, form=form), model, draft)
    with _writing(target, FIELD), _waiting(target, exclusive=True):
        if not (target / MANIFEST_FILE).exists():  # (another start may have made it)
            logger.info("specexpert: writing the expert pack of %s to %s", model, target)
            started = time.perf_counter()
            manifest = _pack(model, target, form, FIELD, "disk", draft)
            logger.info(
                "specexpert: expert pack written: %.2f GB in %.1f s",
                manifest.records_bytes / 1e9,
                time.perf_counter() - started,
            )
        return _with_draft(ExpertPack(target, model=model, form=form), model, draft)


def _with_draft(pack: ExpertPack, model: str, draft: DraftForm | None) -> ExpertPack:
    """``pack``, refused when the draft's experts are wanted (a ``draft`` form) and it
    has none."""
    if draft is not None and not pack.has_draft:
        raise SpecExpertConfigError(
            FIELD,
            f"{pack.path} holds no experts of the lookahead draft (a pack made without --draft)",
            f"`specexpert pack {model} --out {pack.path} --draft` writes the pack again "
            f"with them; or remove {pack.path}: the next start makes it with them",
        )
    return pack


@contextmanager
def _waiting(target: Path, exclusive: bool) -> Iterator[None]:
    """Holds ``target``'s lock, logging once whom it waits for."""
    lock = PackLock(target)
    try:
        lock.acquire(exclusive, wait=False)
    except PackBusy as busy:
        logger.info("specexpert: waiting for %s (%s)", target, busy)
        lock.acquire(exclusive, wait=True)
    except NotALockFile as error:
        raise SpecExpertConfigError(
            FIELD, str(error), "remove it: the lock file is made again"
        ) from None
    try:
        yield
    finally:
        lock.release()
