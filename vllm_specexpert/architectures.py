"""What the plugin can run: the MoE architectures it has been tested on (and their routing
shape), unquantized weights, one device. Checked in one place, :func:`check_supported`."""

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


def check_supported(vllm_config: Any) -> None:
    """Raise :class:`SpecExpertUnsupportedError` for a model or engine setup the
    offloaded layer cannot run: an unsupported architecture, quantized weights, or
    tensor/pipeline/data/expert parallelism. Called where the engine config is built
    (the calling process: one clear error before any engine process starts) and again
    by each offloaded layer (engines built without ``EngineArgs``)."""
    model_config = vllm_config.model_config
    moe_shape(model_config.hf_config)
    if model_config.quantization is not None:
        raise SpecExpertUnsupportedError(
            f"quantization '{model_config.quantization}'",
            "offloading supports unquantized checkpoints only for now",
            "use a bf16/fp16/fp32 checkpoint, or drop the specexpert config",
        )
    parallel = vllm_config.parallel_config
    if (
        parallel.tensor_parallel_size > 1
        or parallel.pipeline_parallel_size > 1
        or parallel.data_parallel_size > 1
        or parallel.enable_expert_parallel
    ):
        raise SpecExpertUnsupportedError(
            "tensor/pipeline/data/expert parallelism",
            "the offloaded layer runs on a single device for now",
            "use tensor_parallel_size=1, pipeline_parallel_size=1, no expert parallelism",
        )
