"""What every artifact directory (calibration, path predictor) shares: a ``manifest.json``
with a format and the fingerprint of the model it was made for, and a safetensors file
whose tensors are checked by name, shape and finiteness. Anything wrong is one
:class:`~vllm_specexpert.config.SpecExpertConfigError` naming the config field that
points at the directory."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from vllm_specexpert.config import SpecExpertConfigError

FINGERPRINT_CONFIG_KEYS = ("architectures", "hidden_size", "num_hidden_layers", "num_experts",
                           "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                           "vocab_size")
"""Config keys of the fingerprint (transformers 5 writes Qwen3-MoE's expert count as
``num_local_experts``, older configs as ``num_experts``)."""


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


def check_matches_model(manifest: dict, model: str, hf_config=None, field: str = "calibration",
                        fix: str | None = None) -> None:
    """Raise a config error naming ``field`` unless ``manifest`` (of a calibration, or
    any artifact that carries ``model_fingerprint``) was made for ``model`` (a local
    directory: router weights compared by hash; otherwise the shapes in ``hf_config``
    only)."""
    made_for = manifest.get("model_fingerprint", {})
    if Path(model, "config.json").exists():
        actual = model_fingerprint(model)
    elif hf_config is not None:
        actual = {k: getattr(hf_config, k, None) for k in FINGERPRINT_CONFIG_KEYS}
        made_for = {k: made_for.get(k) for k in FINGERPRINT_CONFIG_KEYS}
    else:
        return
    different = sorted(k for k in actual if actual[k] != made_for.get(k))
    if different:
        raise SpecExpertConfigError(
            field,
            f"made for another model (differs in {', '.join(different)}; made for "
            f"{manifest.get('model', '?')})",
            fix or f"run `specexpert calibrate {model} --out DIR` and point '{field}' at DIR",
        )


def read_manifest(path: Path, field: str, weights_file: str, fmt: str, fix: str) -> dict:
    """The ``manifest.json`` of an artifact directory (calibration, path predictor), its
    ``format`` checked; anything wrong is one config error naming ``field``."""
    manifest_path = path / "manifest.json"
    if not manifest_path.exists() or not (path / weights_file).exists():
        raise SpecExpertConfigError(
            field, f"{path} is not a {field} directory (no manifest.json or {weights_file})",
            fix)
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise SpecExpertConfigError(field, f"{manifest_path}: not JSON ({exc})", fix) from None
    found = manifest.get("format") if isinstance(manifest, dict) else manifest
    if found != fmt:
        raise SpecExpertConfigError(field, f"{manifest_path}: format {found!r}, expected "
                                    f"{fmt!r}", f"recreate it with this version ({fix})")
    return manifest


def check_tensors(field: str, file: Path, tensors: dict[str, torch.Tensor],
                  expected: dict[str, tuple[int, ...]], fix: str) -> None:
    """Every tensor of ``expected`` present in ``tensors`` with its shape, no other
    tensor, floating-point values finite: anything else is one config error naming
    ``field``, the tensor and, for a shape, both shapes."""
    def bad(problem: str) -> SpecExpertConfigError:
        return SpecExpertConfigError(field, f"{file}: {problem}", fix)

    for key, shape in expected.items():
        if key not in tensors:
            raise bad(f"no tensor {key}")
        tensor = tensors[key]
        if tuple(tensor.shape) != tuple(shape):
            raise bad(f"{key} has shape {list(tensor.shape)}, expected {list(shape)}")
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise bad(f"{key} has non-finite values")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise bad(f"unexpected tensor {unexpected[0]}"
                  f"{f' (and {len(unexpected) - 1} more)' if len(unexpected) > 1 else ''}")


def save_network(out: Path, weights_file: str, network: torch.nn.Module,
                 manifest: dict) -> None:
    """A trained network's artifact: its state dict and ``manifest.json``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in network.state_dict().items()},
              str(out / weights_file))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))


def load_network_weights(path: Path, field: str, weights_file: str,
                         network: torch.nn.Module, fix: str) -> torch.nn.Module:
    """``network`` (built from its manifest) with the artifact's weights, in eval mode:
    an unreadable file, a missing, extra, misshapen or non-finite tensor is one config
    error naming ``field``."""
    from safetensors.torch import load_file

    try:
        state = load_file(str(path / weights_file))
    except Exception as exc:  # noqa: BLE001 - truncated or not a safetensors file
        raise SpecExpertConfigError(
            field, f"{path / weights_file}: unreadable ({str(exc).splitlines()[0]})",
            fix) from None
    expected = {k: tuple(v.shape) for k, v in network.state_dict().items()}
    check_tensors(field, path / weights_file, state, expected, fix)
    network.load_state_dict(state)
    return network.eval()

