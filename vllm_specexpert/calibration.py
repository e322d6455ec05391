"""Calibration data: what the run-time predictors and miss policies read at engine start.

Written by ``specexpert calibrate`` (:mod:`vllm_specexpert.tools.calibrate`) into a
directory:

* ``calibration.safetensors``: ``layers.{i}.default_vectors [E, H] float32`` (mean output
  of expert e over the tokens routed to it, before gate weighting: speculating-experts
  §3.1), ``layers.{i}.counts [E] int64`` (tokens routed to each expert),
  ``layers.{i}.coactivation [E, E] int64`` (tokens that selected both a and b; the
  diagonal is the routing count), ``layers.{i}.tae_percentiles [101] float32`` (0th..100th
  percentile of the Token Activating Entropy, BuddyMoE eq. 1),
  ``layers.{i}.residual_rms [1] float32`` (mean RMS of the post-attention residual r_l),
  where ``i`` is the model's decoder-layer index.
* ``manifest.json``: ``{"format": "specexpert-calibration/2", "model_fingerprint",
  "data": {"description", "sha256", "tokens"}, "moe_layer_indices", "num_experts",
  "hidden_size", "window"}``.

:func:`load_calibration` reads it back and refuses a calibration made for another model
(:func:`model_fingerprint`: shapes and a hash of every router weight).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_specexpert.config import SpecExpertConfigError

FORMAT = "specexpert-calibration/2"
WEIGHTS_FILE = "calibration.safetensors"
FINGERPRINT_CONFIG_KEYS = ("architectures", "hidden_size", "num_hidden_layers", "num_experts",
                           "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                           "vocab_size")
"""Config keys of the fingerprint (transformers 5 writes Qwen3-MoE's expert count as
``num_local_experts``, older configs as ``num_experts``)."""


@dataclass
class Calibration:
    manifest: dict
    default_vectors: dict[int, torch.Tensor]
    """Decoder-layer index -> ``[E, H]`` float32."""
    counts: dict[int, torch.Tensor]
    coactivation: dict[int, torch.Tensor]
    tae_percentiles: dict[int, torch.Tensor]
    """Decoder-layer index -> ``[101]`` percentiles of the Token Activating Entropy."""
    residual_rms: dict[int, float]
    """Decoder-layer index -> mean over tokens of the RMS of r_l."""


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


def save(out: Path, calibration: Calibration) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i in calibration.manifest["moe_layer_indices"]:
        tensors[f"layers.{i}.default_vectors"] = calibration.default_vectors[i].contiguous()
        tensors[f"layers.{i}.counts"] = calibration.counts[i].contiguous()
        tensors[f"layers.{i}.coactivation"] = calibration.coactivation[i].contiguous()
        tensors[f"layers.{i}.tae_percentiles"] = calibration.tae_percentiles[i].contiguous()
        tensors[f"layers.{i}.residual_rms"] = torch.tensor([calibration.residual_rms[i]])
    save_file(tensors, str(out / WEIGHTS_FILE))
    (out / "manifest.json").write_text(json.dumps(calibration.manifest, indent=1))


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


TENSORS = {
    "default_vectors": lambda e, h: (e, h),
    "counts": lambda e, h: (e,),
    "coactivation": lambda e, h: (e, e),
    "tae_percentiles": lambda e, h: (101,),
    "residual_rms": lambda e, h: (1,),
}
"""Per MoE layer ``i``: ``layers.{i}.{name}`` and its shape for E experts, hidden size H."""


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


def load_calibration(path: str | Path, model: str | None = None, hf_config=None,
                     num_experts: int | None = None) -> Calibration:
    """Read a calibration directory and check all of it: the manifest, the model it was
    made for (``model``), every tensor present with the shape the manifest's (and, when
    given, the model's) expert count and hidden size imply, and finite values. Anything
    wrong is one :class:`SpecExpertConfigError` naming ``calibration``."""
    from safetensors.torch import load_file

    path = Path(path)
    fix = "create one with `specexpert calibrate MODEL --out DIR`"
    manifest_path = path / "manifest.json"
    manifest = read_manifest(path, "calibration", WEIGHTS_FILE, FORMAT, fix)

    def bad(problem: str) -> SpecExpertConfigError:
        return SpecExpertConfigError("calibration", problem, fix)

    layers, experts, hidden = (manifest.get(k) for k in
                               ("moe_layer_indices", "num_experts", "hidden_size"))
    if not (isinstance(layers, list) and layers and all(isinstance(i, int) for i in layers)
            and isinstance(experts, int) and isinstance(hidden, int)):
        raise bad(f"{manifest_path}: needs moe_layer_indices (a list of layer indices), "
                  "num_experts and hidden_size (integers)")
    if model is not None:
        check_matches_model(manifest, model, hf_config)
    if num_experts is not None and experts != num_experts:
        raise bad(f"{manifest_path}: num_experts {experts}, the model has {num_experts}")
    model_hidden = getattr(hf_config, "hidden_size", None)
    if model_hidden is not None and hidden != model_hidden:
        raise bad(f"{manifest_path}: hidden_size {hidden}, the model has {model_hidden}")
    try:
        tensors = load_file(str(path / WEIGHTS_FILE))
    except Exception as exc:  # truncated or not a safetensors file
        raise bad(f"{path / WEIGHTS_FILE}: unreadable ({str(exc).splitlines()[0]})") from None
    expected = {f"layers.{i}.{name}": shape_of(experts, hidden)
                for i in layers for name, shape_of in TENSORS.items()}
    present = {k: v for k, v in tensors.items() if k in expected}  # other layers' are ignored
    check_tensors("calibration", path / WEIGHTS_FILE, present, expected, fix)
    for key, tensor in present.items():
        if not tensor.is_floating_point() and (tensor < 0).any():
            raise bad(f"{key} has negative counts")
    return Calibration(
        manifest,
        {i: tensors[f"layers.{i}.default_vectors"] for i in layers},
        {i: tensors[f"layers.{i}.counts"] for i in layers},
        {i: tensors[f"layers.{i}.coactivation"] for i in layers},
        {i: tensors[f"layers.{i}.tae_percentiles"] for i in layers},
        {i: float(tensors[f"layers.{i}.residual_rms"]) for i in layers},
    )
