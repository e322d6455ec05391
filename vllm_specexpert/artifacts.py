"""What every artifact (calibration, estimator, analysis, path predictor) shares: a
manifest with a format and the fingerprint of the model it was made for, checked on read
against its schema (a pydantic model next to its loader, built from the pieces here:
:class:`ModelFingerprint`, :class:`ArtifactManifest`, the bounded sizes), and a
safetensors file whose tensors are checked by name and shape (from its header, before
anything is allocated) and finiteness. Anything wrong is one
:class:`~vllm_specexpert.config.SpecExpertConfigError` naming the config field that
points at the directory, the file, the key, and the command that remakes it."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any, TypeVar

import torch
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
)

from vllm_specexpert.config import SpecExpertConfigError

FINGERPRINT_CONFIG_KEYS = (
    "architectures",
    "hidden_size",
    "num_hidden_layers",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "vocab_size",
)
"""Config keys of the fingerprint (transformers 5 writes Qwen3-MoE's expert count as
``num_local_experts``, older configs as ``num_experts``)."""

MAX_MANIFEST_BYTES = 64 << 20
"""The largest manifest read: a pack's of a model of 60 MoE layers of 256 experts is
about 1 MB."""

# Sane upper bounds of a manifest's sizes: far above any released model, and low enough
# that a corrupt value is refused by the schema rather than attempted.
MAX_HIDDEN = 1 << 16
MAX_EXPERTS = 1 << 16
MAX_LAYERS = 1 << 12
MAX_VOCAB = 1 << 22

# Strict: JSON types exactly (a string or a boolean where a number goes is corruption,
# not something to coerce).
Str = Annotated[str, Strict()]
HiddenSize = Annotated[int, Strict(), Field(ge=1, le=MAX_HIDDEN)]
ExpertCount = Annotated[int, Strict(), Field(ge=1, le=MAX_EXPERTS)]
TopK = Annotated[int, Strict(), Field(ge=1, le=MAX_EXPERTS)]
LayerIndex = Annotated[int, Strict(), Field(ge=0, lt=MAX_LAYERS)]
LayerCount = Annotated[int, Strict(), Field(ge=1, le=MAX_LAYERS)]
VocabSize = Annotated[int, Strict(), Field(ge=1, le=MAX_VOCAB)]
Sha256 = Annotated[str, Strict(), Field(pattern=r"^[0-9a-f]{64}$")]
ConfigValue = Annotated[int, Strict(), Field(ge=0)]
"""A fingerprint's config number: only compared with the model's, never allocated."""


def _increasing(layers: list[int]) -> list[int]:
    # Transitions pair neighbours: each MoE layer once, in the model's order.
    if any(a >= b for a, b in pairwise(layers)):
        raise ValueError(f"{layers} is not increasing (each MoE layer once, in order)")
    return layers


LayerIndices = Annotated[list[LayerIndex], Field(min_length=1), AfterValidator(_increasing)]
"""A manifest's ``moe_layer_indices``: the model's decoder-layer index of each MoE layer."""


def top_k_of(top_k: int, info: ValidationInfo) -> int:
    """A shape's ``top_k`` validator: at most its ``num_experts`` (declared before it)."""
    experts = info.data.get("num_experts")
    if experts is not None and top_k > experts:
        raise ValueError(f"{top_k} is above num_experts {experts}")
    return top_k


MANIFEST = ConfigDict(extra="allow", protected_namespaces=())
"""Every manifest schema's: unknown keys kept (writers add info keys)."""
SHAPE = ConfigDict(extra="forbid")
"""A network's shape: an unknown key is a network this version cannot build."""


class ModelFingerprint(BaseModel):
    """``model_fingerprint`` as :func:`model_fingerprint` writes it: the config keys of
    :data:`FINGERPRINT_CONFIG_KEYS` and ``router_sha256``. A key left out means what
    ``null`` means (the config has no such key): compared as such, so a fingerprint
    missing a key the model has is one of another model."""

    model_config = MANIFEST

    architectures: list[Str] | None = None
    hidden_size: ConfigValue | None = None
    num_hidden_layers: ConfigValue | None = None
    num_experts: ConfigValue | None = None
    num_local_experts: ConfigValue | None = None
    num_experts_per_tok: ConfigValue | None = None
    moe_intermediate_size: ConfigValue | None = None
    vocab_size: ConfigValue | None = None
    router_sha256: Sha256 | None = None

    def as_dict(self) -> dict[str, Any]:
        """Every key, as :func:`model_fingerprint` returns it (``None`` where absent)."""
        return {k: getattr(self, k) for k in (*FINGERPRINT_CONFIG_KEYS, "router_sha256")}

    def disagreement(
        self,
        hidden_size: int | None = None,
        num_experts: int | None = None,
        top_k: int | None = None,
        vocab_size: int | None = None,
    ) -> str | None:
        """The first size an artifact states (its shape) unlike this fingerprint's (the
        model it says it was made for), as ``"name X, the fingerprint's Y"``; ``None``
        when they agree or the fingerprint does not say."""
        experts = {n for n in (self.num_experts, self.num_local_experts) if n is not None}
        if num_experts is not None and experts and num_experts not in experts:
            return f"num_experts {num_experts}, the fingerprint's {sorted(experts)[0]}"
        for name, value, made_for in (
            ("hidden_size", hidden_size, self.hidden_size),
            ("top_k", top_k, self.num_experts_per_tok),
            ("vocab_size", vocab_size, self.vocab_size),
        ):
            if value is not None and made_for is not None and value != made_for:
                return f"{name} {value}, the fingerprint's {made_for}"
        return None


class MadeForModel(BaseModel):
    """What every artifact says about its model: the path it was made from (for
    messages) and its fingerprint (:func:`check_matches_model` compares it)."""

    model_config = MANIFEST

    model: Str | None = None
    model_fingerprint: ModelFingerprint | None = None


class ArtifactManifest(MadeForModel):
    """An artifact directory's ``manifest.json``: also its format (checked first, by
    :func:`read_manifest`)."""

    format: Str


Schema = TypeVar("Schema", bound=BaseModel)


def manifest_error(
    error: ValidationError, field: str, file: Path, fix: str
) -> SpecExpertConfigError:
    """Pydantic's first complaint about ``file`` as one config error naming ``field``,
    the file and the key (``shape.latent``, ``transitions.3.quasi_hidden.recall``)."""
    errors = error.errors(include_url=False)
    first = errors[0]
    key = ".".join(str(part) for part in first["loc"]) or "(the whole file)"
    kind = first["type"]
    value = repr(first.get("input"))
    got = f" (got {value if len(value) <= 40 else value[:37] + '...'})"
    if kind == "missing":
        problem = "missing"
    elif kind == "value_error":
        problem = str(first["ctx"]["error"])
    elif kind in ("extra_forbidden", "unexpected_keyword_argument"):
        problem = "unknown key (a setting of a network this version cannot build)"
    elif kind in ("model_type", "model_attributes_type", "dataclass_type", "dict_type"):
        problem = f"should be a JSON object{got}"
    else:
        problem = f"{first['msg']}{got}"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    problem = f"{file}: key {key}: {problem}{more}".replace("\n", " ")
    return SpecExpertConfigError(field, problem, fix)


def parse_manifest(schema: type[Schema], data: Any, field: str, file: Path, fix: str) -> Schema:
    """``data`` (a manifest read from ``file``) checked against ``schema``: one config
    error naming ``field`` for anything wrong."""
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        raise manifest_error(error, field, file, fix) from None


def model_fingerprint(model_dir: str | Path) -> dict:
    """Architecture, shapes, and a hash of every router weight: enough to refuse data
    computed for another model."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    h = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in sorted(f.keys()):
                if key.endswith("mlp.gate.weight"):
                    h.update(key.encode())
                    h.update(f.get_tensor(key).float().numpy().tobytes())
    return {**{k: config.get(k) for k in FINGERPRINT_CONFIG_KEYS}, "router_sha256": h.hexdigest()}


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes (an artifact that depends on another one, like the
    estimator on its calibration, records it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_matches_model(
    manifest: MadeForModel,
    model: str,
    hf_config: object | None = None,
    field: str = "calibration",
    fix: str | None = None,
) -> None:
    """Raise a config error naming ``field`` unless ``manifest`` (checked against its
    schema) was made for ``model`` (a local directory: router weights compared by hash;
    otherwise the shapes in ``hf_config`` only)."""
    fix = fix or f"run `specexpert calibrate {model} --out DIR` and point '{field}' at DIR"
    if manifest.model_fingerprint is None:
        raise SpecExpertConfigError(
            field,
            "does not say which model it was made for (no model_fingerprint: made "
            "by an older version, or by hand)",
            fix,
        )
    made_for = manifest.model_fingerprint.as_dict()
    if Path(model, "config.json").exists():
        actual = model_fingerprint(model)
    elif hf_config is not None:
        actual = {k: getattr(hf_config, k, None) for k in FINGERPRINT_CONFIG_KEYS}
        # The fingerprint holds config.json's keys as written; the config object also
        # answers an alias (transformers 5's Qwen3-MoE: num_experts -> num_local_experts)
        # with its target's value, so an alias the file left out takes the target's.
        for alias, target in getattr(hf_config, "attribute_map", {}).items():
            if made_for.get(alias) is None and target in made_for:
                made_for[alias] = made_for[target]
    else:
        return
    different = sorted(k for k in actual if actual[k] != made_for.get(k))
    if different:
        raise SpecExpertConfigError(
            field,
            f"made for another model (differs in {', '.join(different)}; made for "
            f"{manifest.model or '?'})",
            fix,
        )


def read_manifest(
    path: Path, field: str, weights_file: str, fmt: str, fix: str, schema: type[Schema]
) -> Schema:
    """The ``manifest.json`` of an artifact directory, its ``format`` checked, then the
    rest against ``schema``; anything wrong is one config error naming ``field``."""
    manifest_path = path / "manifest.json"
    if not manifest_path.exists() or not (path / weights_file).exists():
        raise SpecExpertConfigError(
            field, f"{path} is not a {field} directory (no manifest.json or {weights_file})", fix
        )
    try:
        text = _read_manifest_bytes(manifest_path, field, fix)
    except OSError as exc:
        raise SpecExpertConfigError(field, f"{manifest_path}: unreadable ({exc})", fix) from None
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        raise SpecExpertConfigError(field, f"{manifest_path}: not JSON ({exc})", fix) from None
    except RecursionError:
        raise SpecExpertConfigError(
            field, f"{manifest_path}: nested deeper than JSON is read here (not a manifest)", fix
        ) from None
    found = manifest.get("format") if isinstance(manifest, dict) else manifest
    if found != fmt:
        raise SpecExpertConfigError(
            field,
            f"{manifest_path}: format {found!r}, expected {fmt!r}",
            f"recreate it with this version ({fix})",
        )
    return parse_manifest(schema, manifest, field, manifest_path, fix)


def _read_manifest_bytes(path: Path, field: str, fix: str) -> bytes:
    """The bytes of the manifest at ``path``: a regular file of at most
    :data:`MAX_MANIFEST_BYTES` (a FIFO, a device or a link to one is refused before it is
    read: opened without blocking, checked by the open file's own status)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):
        os.close(fd)
        raise SpecExpertConfigError(
            field,
            f"{path} is not a regular file ({_file_kind(status.st_mode)}; not one this "
            "version wrote)",
            fix,
        )
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise SpecExpertConfigError(
            field,
            f"{path} has {max(status.st_size, len(data))} bytes, past the "
            f"{MAX_MANIFEST_BYTES >> 20} MiB any manifest takes (not one this version wrote)",
            fix,
        )
    return data


def _file_kind(mode: int) -> str:
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    return next((name for test, name in kinds.items() if test(mode)), "not a file")


def check_shapes(
    field: str,
    file: Path,
    shapes: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[int, ...]],
    fix: str,
) -> None:
    """Every tensor of ``expected`` present in ``shapes`` (name -> shape) with its shape,
    no other tensor: anything else is one config error naming ``field``, the tensor and,
    for a shape, both shapes."""

    def bad(problem: str) -> SpecExpertConfigError:
        return SpecExpertConfigError(field, f"{file}: {problem}", fix)

    for key, shape in expected.items():
        if key not in shapes:
            raise bad(f"no tensor {key}")
        if tuple(shapes[key]) != tuple(shape):
            raise bad(f"{key} has shape {list(shapes[key])}, expected {list(shape)}")
    unexpected = sorted(set(shapes) - set(expected))
    if unexpected:
        raise bad(
            f"unexpected tensor {unexpected[0]}"
            f"{f' (and {len(unexpected) - 1} more)' if len(unexpected) > 1 else ''}"
        )


def check_tensors(
    field: str,
    file: Path,
    tensors: dict[str, torch.Tensor],
    expected: dict[str, tuple[int, ...]],
    fix: str,
) -> None:
    """:func:`check_shapes` of ``tensors``, and floating-point values finite."""
    check_shapes(field, file, {k: tuple(v.shape) for k, v in tensors.items()}, expected, fix)
    for key in expected:
        tensor = tensors[key]
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise SpecExpertConfigError(field, f"{file}: {key} has non-finite values", fix)


def stored_shapes(field: str, file: Path, fix: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a safetensors file, from its header alone (nothing is
    loaded; safetensors checks the header against the file's size, so these shapes are
    bounded by the bytes on disk). Unreadable: one config error naming ``field``."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    except Exception as exc:  # noqa: BLE001 - truncated or not a safetensors file
        raise SpecExpertConfigError(
            field, f"{file}: unreadable ({str(exc).splitlines()[0]})", fix
        ) from None
