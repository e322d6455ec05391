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
* ``manifest.json``: ``{"format": "specexpert-calibration/2", "model", "model_fingerprint",
  "data": {"description", "sha256", "tokens"}, "moe_layer_indices", "num_experts",
  "hidden_size", "window"}`` (``model``: the model's name,
  :func:`~vllm_specexpert.tools.provenance.model_label`).

``DIR`` is new, empty, or a calibration written before (rewritten).

:func:`vllm_specexpert.calibration.load_calibration` reads it back at engine start.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import torch

from vllm_specexpert.artifacts import model_fingerprint
from vllm_specexpert.calibration import FORMAT, Calibration, save
from vllm_specexpert.policy.buddies import token_activating_entropy
from vllm_specexpert.tools.arguments import artifact_of, check_output_dir
from vllm_specexpert.tools.provenance import model_label
from vllm_specexpert.tools.trace import (
    add_data_arguments,
    load_model,
    moe_layer_indices,
    resolve_data_arguments,
    trace,
)


def calibrate(
    model_dir,
    documents,
    out,
    window: int = 256,
    max_tokens: int | None = None,
    description: str = "",
) -> Calibration:
    model, tokenizer = load_model(model_dir)
    layers = moe_layer_indices(model)
    E, H = model.config.num_experts, model.config.hidden_size
    sums = {i: torch.zeros(E, H, dtype=torch.float64) for i in layers}
    coactivation = {i: torch.zeros(E, E, dtype=torch.int64) for i in layers}
    entropies: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    rms_sums = dict.fromkeys(layers, 0.0)
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
        "model": model_label(model_dir),
        "model_fingerprint": model_fingerprint(model_dir),
        "data": {"description": description, "sha256": data_hash.hexdigest(), "tokens": tokens},
        "moe_layer_indices": layers,
        "num_experts": E,
        "hidden_size": H,
        "window": window,
    }
    result = Calibration(
        manifest,
        vectors,
        counts,
        coactivation,
        tae,
        {i: rms_sums[i] / max(tokens, 1) for i in layers},
    )
    save(Path(out), result)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_arguments(parser)
    parser.add_argument("--out", required=True, type=Path)


def run(args: argparse.Namespace) -> None:
    check_output_dir(args.out, "--out", artifact_of(FORMAT), "a calibration")
    model, docs, description = resolve_data_arguments(args, default_split="train")
    result = calibrate(
        model,
        docs,
        args.out,
        window=args.window,
        max_tokens=args.max_tokens,
        description=description,
    )
    print(
        f"calibrated {len(result.default_vectors)} MoE layers on "
        f"{result.manifest['data']['tokens']:,} tokens ({description}) -> {args.out}"
    )
