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
(:func:`~vllm_specexpert.artifacts.model_fingerprint`: shapes and a hash of every router
weight).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
from pydantic import Field, Strict, ValidationInfo, field_validator

from vllm_specexpert.artifacts import (
    ArtifactManifest,
    ExpertCount,
    HiddenSize,
    LayerIndices,
    ModelFingerprint,
    check_matches_model,
    check_tensors,
    read_manifest,
)
from vllm_specexpert.config import SpecExpertConfigError

FORMAT = "specexpert-calibration/2"
WEIGHTS_FILE = "calibration.safetensors"
REMAKE = "remake it with `specexpert calibrate MODEL --out DIR`"


class CalibrationManifest(ArtifactManifest):
    """``manifest.json`` of a calibration directory (module doc); ``data`` and ``window``
    are information only."""

    model_fingerprint: ModelFingerprint
    moe_layer_indices: LayerIndices
    num_experts: ExpertCount
    hidden_size: HiddenSize
    window: Annotated[int, Strict(), Field(ge=1)] | None = None

    @field_validator("num_experts", "hidden_size")
    @classmethod
    def _the_fingerprints(cls, value: int, info: ValidationInfo) -> int:
        # The tensors' shapes follow these: they must be the model's it was made for.
        fingerprint = info.data.get("model_fingerprint")
        assert info.field_name is not None  # a field validator's info names its field
        differs = fingerprint and fingerprint.disagreement(**{info.field_name: value})
        if differs:
            raise ValueError(differs)
        return value


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


TENSORS = {
    "default_vectors": lambda e, h: (e, h),
    "counts": lambda e, h: (e,),
    "coactivation": lambda e, h: (e, e),
    "tae_percentiles": lambda e, h: (101,),
    "residual_rms": lambda e, h: (1,),
}
"""Per MoE layer ``i``: ``layers.{i}.{name}`` and its shape for E experts, hidden size H."""


def load_calibration(
    path: str | Path,
    model: str | None = None,
    hf_config: object | None = None,
    num_experts: int | None = None,
) -> Calibration:
    """Read a calibration directory and check all of it: the manifest, the model it was
    made for (``model``), every tensor present with the shape the manifest's (and, when
    given, the model's) expert count and hidden size imply, and finite values. Anything
    wrong is one :class:`SpecExpertConfigError` naming ``calibration``."""
    from safetensors.torch import load_file

    path = Path(path)
    fix = REMAKE
    manifest_path = path / "manifest.json"
    manifest = read_manifest(path, "calibration", WEIGHTS_FILE, FORMAT, fix, CalibrationManifest)

    def bad(problem: str) -> SpecExpertConfigError:
        return SpecExpertConfigError("calibration", problem, fix)

    layers, experts, hidden = manifest.moe_layer_indices, manifest.num_experts, manifest.hidden_size
    if model is not None:
        check_matches_model(manifest, model, hf_config)
    if num_experts is not None and experts != num_experts:
        raise bad(f"{manifest_path}: num_experts {experts}, the model has {num_experts}")
    model_hidden = getattr(hf_config, "hidden_size", None)
    if model_hidden is not None and hidden != model_hidden:
        raise bad(f"{manifest_path}: hidden_size {hidden}, the model has {model_hidden}")
    try:
        tensors = load_file(str(path / WEIGHTS_FILE))
    except Exception as exc:  # noqa: BLE001 - truncated or not a safetensors file
        raise bad(f"{path / WEIGHTS_FILE}: unreadable ({str(exc).splitlines()[0]})") from None
    expected = {
        f"layers.{i}.{name}": shape_of(experts, hidden)
        for i in layers
        for name, shape_of in TENSORS.items()
    }
    present = {k: v for k, v in tensors.items() if k in expected}  # other layers' are ignored
    check_tensors("calibration", path / WEIGHTS_FILE, present, expected, fix)
    for key, tensor in present.items():
        if not tensor.is_floating_point() and (tensor < 0).any():
            raise bad(f"{key} has negative counts")
    return Calibration(
        manifest.model_dump(),
        {i: tensors[f"layers.{i}.default_vectors"] for i in layers},
        {i: tensors[f"layers.{i}.counts"] for i in layers},
        {i: tensors[f"layers.{i}.coactivation"] for i in layers},
        {i: tensors[f"layers.{i}.tae_percentiles"] for i in layers},
        {i: float(tensors[f"layers.{i}.residual_rms"]) for i in layers},
    )
