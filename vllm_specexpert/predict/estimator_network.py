"""The neural expert estimator (speculating-experts §6.1, Appendix A): a shallow network
that maps the quasi-hidden state q_l to layer l+1's router logits.

    q_l [T, H] -> A (H -> d) + embedding of the transition l -> l+1
              -> x + C(SiLU(B x))  (d -> m*d -> d, residual)
              -> LayerNorm -> head (d -> E)  = predicted router logits of layer l+1

One network serves every transition (the embedding tells them apart), trained by KL
distillation (``specexpert train-estimator``). Its manifest names the model and the
calibration (q_l depends on its default vectors); another one is refused.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Annotated

import torch
from pydantic import BaseModel, Field, Strict, ValidationInfo, field_validator
from pydantic.dataclasses import dataclass
from torch import nn

from vllm_specexpert.artifacts import (
    MANIFEST,
    MAX_LAYERS,
    SHAPE,
    ExpertCount,
    HiddenSize,
    Sha256,
    Str,
    TopK,
    file_sha256,
    top_k_of,
)
from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.predict.network_file import LayeredNetwork, NetworkFile, NetworkManifest

FORMAT = "specexpert-estimator/1"
WEIGHTS_FILE = "estimator.safetensors"
REMAKE = "remake it with `specexpert train-estimator MODEL --calibration DIR --out EDIR`"


@dataclass(config=SHAPE)
class EstimatorShape:
    """The network's shape (in the manifest), range-checked so a corrupt manifest is
    refused before a network is built."""

    hidden_size: HiddenSize
    """The model's hidden size H (q_l's width)."""
    num_transitions: Annotated[int, Strict(), Field(ge=1, lt=MAX_LAYERS)]
    """Layer transitions l -> l+1 it predicts (MoE layers - 1)."""
    num_experts: ExpertCount
    """Routed experts per layer E."""
    top_k: TopK
    latent: Annotated[int, Strict(), Field(ge=1, le=1 << 16)] = 128
    """The reduced width d after the projection A."""
    mlp_ratio: Annotated[int, Strict(), Field(ge=1, le=64)] = 2
    """The MLP's inner width is ``mlp_ratio * latent`` (the paper's m)."""

    @field_validator("top_k")
    @classmethod
    def _top_k_of_the_experts(cls, top_k: int, info: ValidationInfo) -> int:
        return top_k_of(top_k, info)


class TrainedWith(BaseModel):
    """The estimator manifest's ``calibration``: the one whose default vectors made the
    q_l it was trained on."""

    model_config = MANIFEST

    path: Str | None = None
    sha256: Sha256


class EstimatorManifest(NetworkManifest):
    """``manifest.json`` of a ``train-estimator`` directory (fingerprint and calibration
    required at engine start)."""

    shape: EstimatorShape
    calibration: TrainedWith | None = None

    @field_validator("moe_layer_indices")
    @classmethod
    def _one_transition_per_pair_of_layers(
        cls, layers: list[int], info: ValidationInfo
    ) -> list[int]:
        shape = info.data.get("shape")
        if shape is not None and len(layers) != shape.num_transitions + 1:
            raise ValueError(
                f"{len(layers)} layers for shape.num_transitions "
                f"{shape.num_transitions} (one more layer than transitions)"
            )
        return layers


class ExpertEstimator(LayeredNetwork):
    """``q [T, H]`` and a transition index -> ``[T, E]`` router logits (module doc)."""

    def __init__(self, shape: EstimatorShape, layer_indices: list[int] | None = None) -> None:
        super().__init__()
        self.shape = shape
        self.layer_indices = (
            layer_indices if layer_indices is not None else list(range(shape.num_transitions + 1))
        )
        """The model's decoder-layer index of every MoE layer (transition j predicts
        ``layer_indices[j + 1]`` from ``layer_indices[j]``)."""
        d = shape.latent
        self.project = nn.Linear(shape.hidden_size, d)
        self.transition = nn.Embedding(shape.num_transitions, d)
        self.mlp = nn.Sequential(
            nn.Linear(d, shape.mlp_ratio * d), nn.SiLU(), nn.Linear(shape.mlp_ratio * d, d)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, shape.num_experts)

    def forward(self, q: torch.Tensor, transition: int | torch.Tensor) -> torch.Tensor:
        if isinstance(transition, int):
            transition = torch.full((q.shape[0],), transition, dtype=torch.long, device=q.device)
        x = self.project(q) + self.transition(transition)
        return self.head(self.norm(x + self.mlp(x)))


def distillation_loss(logits: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """KL(router || estimator) over the experts, averaged over tokens."""
    target = torch.log_softmax(router_logits.float(), dim=-1)
    return torch.nn.functional.kl_div(
        torch.log_softmax(logits.float(), dim=-1), target, log_target=True, reduction="batchmean"
    )


ESTIMATOR_FILE = NetworkFile(
    field="estimator",
    command="train-estimator",
    format=FORMAT,
    weights_file=WEIGHTS_FILE,
    schema=EstimatorManifest,
    # fp32 whatever the default dtype (vLLM sets the model's while it loads).
    build=lambda shape, layers: ExpertEstimator(shape, layers).float(),
    remake=REMAKE,
)


def save_estimator(out: Path, model: ExpertEstimator, manifest: dict) -> None:
    """A ``train-estimator`` directory of ``model`` (``manifest``: its model, how it was
    trained)."""
    ESTIMATOR_FILE.save(out, model, manifest)


def load_estimator(
    path: str | Path,
    model: str | None = None,
    hf_config: object | None = None,
    calibration: str | Path | None = None,
) -> ExpertEstimator:
    """Read a ``train-estimator`` directory, checked against ``model`` and
    ``calibration`` if given (errors name ``estimator``)."""
    from vllm_specexpert.calibration import WEIGHTS_FILE as CALIBRATION_FILE

    manifest = ESTIMATOR_FILE.read(path, model, hf_config)
    if calibration is not None and (Path(calibration) / CALIBRATION_FILE).exists():
        trained_with = manifest.calibration
        if trained_with is None or trained_with.sha256 != file_sha256(
            Path(calibration) / CALIBRATION_FILE
        ):
            raise SpecExpertConfigError(
                "estimator",
                f"trained on q_l made with another calibration "
                f"({trained_with.path if trained_with else '?'}), not {calibration}: q_l "
                "depends on its default vectors",
                f'set "calibration" to the one it was '
                f"trained with, or run `specexpert train-estimator MODEL --calibration "
                f"{calibration} --out DIR`",
            )
    return ESTIMATOR_FILE.network(path, manifest)


def transitions_of(network: ExpertEstimator, layers: dict[int, str]) -> dict[str, int]:
    """Layer l's name -> transition index for consecutive MoE ``layers`` (decoder index ->
    name); an untrained pair is a config error."""
    indices = sorted(layers)
    known = {(a, b): j for j, (a, b) in enumerate(pairwise(network.layer_indices))}
    pairs = list(pairwise(indices))
    if any(pair not in known for pair in pairs):
        raise SpecExpertConfigError(
            "estimator",
            f"trained for MoE layers {network.layer_indices}, and the "
            f"offloaded MoE layers are {indices}",
            "run `specexpert train-estimator MODEL --out DIR` for this model",
        )
    return {layers[a]: known[(a, b)] for a, b in pairs}
