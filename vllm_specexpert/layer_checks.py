"""What a config needs of the loaded layers, whatever features it turns on: checked at
engine start and before a ``reconfigure``, never mid-generation (each feature checks its
own needs: :meth:`EngineFeature.check <vllm_specexpert.features.EngineFeature.check>`)."""

from __future__ import annotations

from collections.abc import Iterable

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.layer_state import OffloadedLayer


def check_layers(config: SpecExpertConfig, layers: Iterable[OffloadedLayer]) -> None:
    """Raise a config error when ``config`` needs what the loaded ``layers`` lack."""
    layers = list(layers)
    for layer in layers:
        config.check_fits(layer.experts.num_experts, layer.top_k, layer.experts.packed_format)
    moe_layers = sorted(layer.index for layer in layers)
    unknown = sorted(set(config.exact_layers or ()) - set(moe_layers))
    if unknown:
        raise SpecExpertConfigError(
            "exact_layers",
            f"{unknown} are not MoE layers of this model",
            f"give indices among its MoE layers {moe_layers}",
        )
