"""The MoE architectures the plugin has been tested on, and their routing shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_specexpert.config import SpecExpertUnsupportedError

# architecture -> (config attribute of routed experts per layer, of experts per token)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "Qwen3MoeForCausalLM": ("num_experts", "num_experts_per_tok"),
    "Qwen2MoeForCausalLM": ("num_experts", "num_experts_per_tok"),
    "MixtralForCausalLM": ("num_local_experts", "num_experts_per_tok"),
    "OlmoeForCausalLM": ("num_experts", "num_experts_per_tok"),
    "DeepseekV2ForCausalLM": ("n_routed_experts", "num_experts_per_tok"),
}


@dataclass(frozen=True)
class MoEShape:
    architecture: str
    num_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Routed experts per token."""


def moe_shape(hf_config: Any) -> MoEShape:
    """Routing shape of a Hugging Face config, or a clear error if unsupported."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for arch in architectures:
        if arch in SUPPORTED_ARCHITECTURES:
            experts_attr, topk_attr = SUPPORTED_ARCHITECTURES[arch]
            return MoEShape(
                arch, int(getattr(hf_config, experts_attr)), int(getattr(hf_config, topk_attr))
            )
    raise SpecExpertUnsupportedError(
        f"model architecture {architectures or '(none)'}",
        "expert offloading is tested on " + ", ".join(SUPPORTED_ARCHITECTURES),
        "use one of those architectures, or drop the specexpert config",
    )
