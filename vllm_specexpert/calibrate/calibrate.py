"""Calibration: one offline pass that measures what the run-time predictors need.

    specexpert calibrate [MODEL] [--data FILE... | --split train] --out DIR

Per MoE layer l and expert e it computes the default vector ``d_{l,e}`` (the mean output
of expert e, before gate weighting, over the tokens routed to it; speculating-experts
§3.1), the routing counts (tokens routed to each expert) and the co-activation matrix
(``C[a, b]`` = tokens that selected both a and b; the diagonal is the routing count),
which the buddy-expert policy builds on, and the distribution of each layer's Token
Activating Entropy (BuddyMoE eq. 1: entropy of the renormalised top-k weights / log k),
as percentiles, for per-layer calibration of the buddy policy's gate.

Output (``DIR``):

* ``calibration.safetensors``: ``layers.{i}.default_vectors [E, H] float32``,
  ``layers.{i}.counts [E] int64``, ``layers.{i}.coactivation [E, E] int64``,
  ``layers.{i}.tae_percentiles [101] float32`` (0th..100th),
  ``layers.{i}.residual_rms [1] float32`` (mean RMS of the post-attention residual r_l,
  for the quasi-hidden state), where ``i`` is the model's decoder-layer index.
* ``manifest.json``: ``{"format": "specexpert-calibration/1", "model_fingerprint",
  "data": {"description", "sha256", "tokens"}, "moe_layer_indices", "num_experts",
  "hidden_size", "window"}``.

:func:`load_calibration` reads it back and refuses a calibration made for another model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_specexpert.calibrate.trace import (
    FINGERPRINT_CONFIG_KEYS,
    add_data_arguments,
    load_model,
    model_fingerprint,
    moe_layer_indices,
    resolve_data_arguments,
    trace,
)
from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.policy.buddies import token_activating_entropy

FORMAT = "specexpert-calibration/2"
WEIGHTS_FILE = "calibration.safetensors"


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


def calibrate(model_dir, documents, out, window: int = 256, max_tokens: int | None = None,
              description: str = "") -> Calibration:
    model, tokenizer = load_model(model_dir)
    layers = moe_layer_indices(model)
    E, H = model.config.num_experts, model.config.hidden_size
    sums = {i: torch.zeros(E, H, dtype=torch.float64) for i in layers}
    coactivation = {i: torch.zeros(E, E, dtype=torch.int64) for i in layers}
    entropies: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    rms_sums = {i: 0.0 for i in layers}
    data_hash = hashlib.sha256()
    tokens = 0
    for t in trace(model, tokenizer, documents, window, max_tokens, progress="calibrate"):
        data_hash.update(t.token_ids.numpy().tobytes())
        tokens += len(t.token_ids)
        for j, i in enumerate(layers):
            experts = model.model.layers[i].mlp.experts
            ids = t.topk_ids[:, j]
            onehot = torch.zeros(len(ids), E, dtype=torch.int64).scatter_(1, ids, 1)
            coactivation[i] += onehot.T @ onehot
            entropies[i].append(token_activating_entropy(t.topk_weights[:, j]))
            rms_sums[i] += float(t.residual[:, j].float().pow(2).mean(-1).sqrt().sum())
            x = t.router_input[:, j]
            for e in ids.unique().tolist():
                rows = (ids == e).any(dim=1).nonzero().squeeze(1)
                with torch.no_grad():
                    y = experts(x[rows], torch.full((len(rows), 1), e), torch.ones(len(rows), 1))
                sums[i][e] += y.double().sum(0)
    counts = {i: coactivation[i].diagonal().clone() for i in layers}
    vectors = {i: (sums[i] / counts[i].clamp_min(1)[:, None]).float() for i in layers}
    levels = torch.linspace(0, 1, 101)
    tae = {i: torch.quantile(torch.cat(entropies[i]), levels).float() for i in layers}
    manifest = {
        "format": FORMAT,
        "model": str(model_dir),
        "model_fingerprint": model_fingerprint(model_dir),
        "data": {"description": description, "sha256": data_hash.hexdigest(), "tokens": tokens},
        "moe_layer_indices": layers, "num_experts": E, "hidden_size": H, "window": window,
    }
    result = Calibration(manifest, vectors, counts, coactivation, tae,
                         {i: rms_sums[i] / max(tokens, 1) for i in layers})
    save(Path(out), result)
    return result


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


def check_matches_model(manifest: dict, model: str, hf_config=None) -> None:
    """Raise a ``calibration`` config error unless ``manifest`` was made for ``model``
    (a local directory: router weights compared by hash; otherwise the shapes in
    ``hf_config`` only)."""
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
            "calibration",
            f"made for another model (differs in {', '.join(different)}; made for "
            f"{manifest.get('model', '?')})",
            f"run `specexpert calibrate {model} --out DIR` and point 'calibration' at DIR",
        )


def load_calibration(path: str | Path, model: str | None = None, hf_config=None) -> Calibration:
    """Read a calibration directory, checking it against ``model`` if given."""
    from safetensors.torch import load_file

    path = Path(path)
    manifest_path = path / "manifest.json"
    if not manifest_path.exists() or not (path / WEIGHTS_FILE).exists():
        raise SpecExpertConfigError(
            "calibration", f"{path} is not a calibration directory (no manifest.json or {WEIGHTS_FILE})",
            "create one with `specexpert calibrate MODEL --out DIR`",
        )
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT:
        raise SpecExpertConfigError(
            "calibration", f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}",
            "recreate it with this version's `specexpert calibrate`",
        )
    if model is not None:
        check_matches_model(manifest, model, hf_config)
    tensors = load_file(str(path / WEIGHTS_FILE))
    layers = manifest["moe_layer_indices"]
    return Calibration(
        manifest,
        {i: tensors[f"layers.{i}.default_vectors"] for i in layers},
        {i: tensors[f"layers.{i}.counts"] for i in layers},
        {i: tensors[f"layers.{i}.coactivation"] for i in layers},
        {i: tensors[f"layers.{i}.tae_percentiles"] for i in layers},
        {i: float(tensors[f"layers.{i}.residual_rms"]) for i in layers},
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_arguments(parser)
    parser.add_argument("--out", required=True, type=Path)


def run(args: argparse.Namespace) -> None:
    model, docs, description = resolve_data_arguments(args, default_split="train")
    result = calibrate(model, docs, args.out, window=args.window, max_tokens=args.max_tokens,
                       description=description)
    print(f"calibrated {len(result.default_vectors)} MoE layers on "
          f"{result.manifest['data']['tokens']:,} tokens ({description}) -> {args.out}")
