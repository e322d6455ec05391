"""The MoE architectures the plugin has been tested on, and their routing shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_specexpert.config import SpecExpertUnsupportedError

@dataclass(frozen=True)
class Architecture:
    experts_attr: str
    """Config attribute: routed experts per MoE layer."""
    top_k_attr: str
    """Config attribute: experts per token."""
    vllm_module: str
    """Module of vLLM's implementation (the class is named like the architecture)."""


SUPPORTED_ARCHITECTURES: dict[str, Architecture] = {
    "Qwen3MoeForCausalLM": Architecture("num_experts", "num_experts_per_tok",
                                        "vllm.model_executor.models.qwen3_moe"),
    "Qwen2MoeForCausalLM": Architecture("num_experts", "num_experts_per_tok",
                                        "vllm.model_executor.models.qwen2_moe"),
    "MixtralForCausalLM": Architecture("num_local_experts", "num_experts_per_tok",
                                       "vllm.model_executor.models.mixtral"),
    "OlmoeForCausalLM": Architecture("num_experts", "num_experts_per_tok",
                                     "vllm.model_executor.models.olmoe"),
    "DeepseekV2ForCausalLM": Architecture("n_routed_experts", "num_experts_per_tok",
                                          "vllm.model_executor.models.deepseek_v2"),
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
            spec = SUPPORTED_ARCHITECTURES[arch]
            return MoEShape(
                arch, int(getattr(hf_config, spec.experts_attr)),
                int(getattr(hf_config, spec.top_k_attr)),
            )
    raise SpecExpertUnsupportedError(
        f"model architecture {architectures or '(none)'}",
        "expert offloading is tested on " + ", ".join(SUPPORTED_ARCHITECTURES),
        "use one of those architectures, or drop the specexpert config",
    )
