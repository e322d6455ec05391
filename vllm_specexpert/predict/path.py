"""Routing-path predictor (RPP, ExpertFlow §3.2): one token's experts in every MoE layer
at once, from the sequence's token ids alone.

Not the paper's T5 encoder-decoder but a window model, cheap at every decode step in the
scheduler process where only token ids are known, with no per-request state
(docs/design.md, "The routing-path predictor"):

    ids[t-W+1 .. t]  ->  embeddings, concatenated  ->  MLP  ->  [L, E] logits

Positions before a sequence's first token are padded with id ``vocab_size``. Trained by
``specexpert train-path``; its manifest's fingerprint is checked at engine start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import numpy as np
import torch
from pydantic import Field, Strict, ValidationInfo, field_validator
from pydantic.dataclasses import dataclass
from torch import nn

from vllm_specexpert.artifacts import (
    SHAPE,
    ExpertCount,
    LayerCount,
    TopK,
    VocabSize,
    top_k_of,
)
from vllm_specexpert.predict.network_file import LayeredNetwork, NetworkFile, NetworkManifest

FORMAT = "specexpert-path-predictor/1"
WEIGHTS_FILE = "path_predictor.safetensors"
REMAKE = "remake it with `specexpert train-path MODEL --out DIR`"


@dataclass(config=SHAPE)
class PathPredictorShape:
    """The network's shape (in the manifest), range-checked so a corrupt manifest is
    refused before a network is built."""

    vocab_size: VocabSize
    num_layers: LayerCount
    """MoE layers L."""
    num_experts: ExpertCount
    """Routed experts per layer E."""
    top_k: TopK
    window: Annotated[int, Strict(), Field(ge=1, le=4096)] = 8
    """Token ids it reads: the token about to be decoded and ``window - 1`` before it."""
    embed_dim: Annotated[int, Strict(), Field(ge=1, le=1 << 14)] = 48
    hidden: Annotated[int, Strict(), Field(ge=1, le=1 << 16)] = 512

    @field_validator("top_k")
    @classmethod
    def _top_k_of_the_experts(cls, top_k: int, info: ValidationInfo) -> int:
        return top_k_of(top_k, info)


class PathPredictorManifest(NetworkManifest):
    """``manifest.json`` of a ``train-path`` directory (format, shape, the MoE layers it
    predicts; the fingerprint, refused at engine start when absent)."""

    shape: PathPredictorShape

    @field_validator("moe_layer_indices")
    @classmethod
    def _one_row_per_layer(cls, layers: list[int], info: ValidationInfo) -> list[int]:
        shape = info.data.get("shape")
        if shape is not None and len(layers) != shape.num_layers:
            raise ValueError(f"{len(layers)} layers for shape.num_layers {shape.num_layers}")
        return layers


class RoutingPathPredictor(LayeredNetwork):
    """``[B, W]`` token ids -> ``[B, L, E]`` routing logits (see module doc)."""

    def __init__(self, shape: PathPredictorShape, layer_indices: list[int] | None = None) -> None:
        super().__init__()
        self.shape = shape
        self.layer_indices = (
            layer_indices if layer_indices is not None else list(range(shape.num_layers))
        )
        """The model's decoder-layer index of each predicted MoE layer."""
        self.embed = nn.Embedding(shape.vocab_size + 1, shape.embed_dim)  # + padding id
        self.mlp = nn.Sequential(
            nn.Linear(shape.window * shape.embed_dim, shape.hidden),
            nn.GELU(),
            nn.Linear(shape.hidden, shape.hidden),
            nn.GELU(),
            nn.Linear(shape.hidden, shape.num_layers * shape.num_experts),
        )

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        shape = self.shape
        h = self.embed(windows).flatten(1)
        return self.mlp(h).view(-1, shape.num_layers, shape.num_experts)

    @torch.no_grad()
    def predict_topk(self, windows: torch.Tensor) -> torch.Tensor:
        """``[B, L, K]`` the K most likely experts of every layer, per window."""
        return self.forward(windows).topk(self.shape.top_k, dim=-1).indices

    def windows_of(self, sequences: list[list[int]]) -> torch.Tensor:
        """``[B, W]`` the last ``window`` ids of each sequence, left-padded."""
        w, pad = self.shape.window, self.shape.vocab_size
        out = np.full((len(sequences), w), pad, dtype=np.int64)
        for row, ids in enumerate(sequences):
            tail = ids[-w:]
            if tail:
                out[row, w - len(tail) :] = tail
        return torch.from_numpy(out)


def sliding_windows(token_ids: torch.Tensor, window: int, pad: int) -> torch.Tensor:
    """``[T, window]``: for each position t of one sequence, ids ``t-window+1 .. t``,
    left-padded with ``pad`` before the sequence starts."""
    padded = torch.cat([torch.full((window - 1,), pad, dtype=token_ids.dtype), token_ids])
    return padded.unfold(0, window, 1)


PATH_PREDICTOR_FILE = NetworkFile(
    field="path_predictor",
    command="train-path",
    format=FORMAT,
    weights_file=WEIGHTS_FILE,
    schema=PathPredictorManifest,
    build=RoutingPathPredictor,
    remake=REMAKE,
)


def save_path_predictor(out: Path, model: RoutingPathPredictor, manifest: dict) -> None:
    """A ``train-path`` directory of ``model`` (``manifest``: its model, how it was
    trained)."""
    PATH_PREDICTOR_FILE.save(out, model, manifest)


def load_path_predictor(
    path: str | Path, model: str | None = None, hf_config: object | None = None
) -> RoutingPathPredictor:
    """Read a ``train-path`` directory, checked against ``model`` if given (errors name
    ``path_predictor``)."""
    return PATH_PREDICTOR_FILE.load(path, model, hf_config)
