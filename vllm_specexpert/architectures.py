"""What the plugin can run: the MoE architectures it has been tested on (and their routing
shape), unquantized or packed-quantized experts (:mod:`.quant_formats`), one device.
Checked in one place, :func:`check_supported`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_specexpert.config import SpecExpertUnsupportedError
from vllm_specexpert.quant_formats import PackedFormat, format_of


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
    "GptOssForCausalLM": Architecture("num_local_experts", "num_experts_per_tok",
                                      "vllm.model_executor.models.gpt_oss"),
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
    offloaded layer cannot run: an unsupported architecture, a quantization it cannot
    dequantize, or tensor/pipeline/data/expert parallelism. Called where the engine config is built
    (the calling process: one clear error before any engine process starts) and again
    by each offloaded layer (engines built without ``EngineArgs``)."""
    model_config = vllm_config.model_config
    moe_shape(model_config.hf_config)
    if model_config.quantization is not None:
        checkpoint = getattr(model_config.hf_config, "quantization_config", None)
        if not checkpoint:
            raise SpecExpertUnsupportedError(
                f"quantization '{model_config.quantization}' of an unquantized checkpoint",
                "offloaded experts are dequantized from a quantized checkpoint, not "
                "quantized while loading",
                "quantize it first (specexpert quantize), or drop --quantization")
        format_of(dict(checkpoint))
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


def packed_format(vllm_config: Any, layer_name: str) -> PackedFormat | None:
    """The format a layer's routed experts are packed in, ``None`` when they are not
    quantized (no quantization, or the checkpoint leaves this layer out)."""
    checkpoint = getattr(vllm_config.model_config.hf_config, "quantization_config", None)
    if vllm_config.model_config.quantization is None or not checkpoint:
        return None
    fmt = format_of(dict(checkpoint))
    return None if fmt is None or fmt.skips(layer_name) else fmt
