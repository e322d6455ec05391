"""What the plugin can run: the MoE architectures it has been tested on (and their routing
shape), unquantized or packed-quantized experts (:mod:`.quant_formats`), one device.
Checked in one place, :func:`check_supported`."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_specexpert.config import SpecExpertUnsupportedError
from vllm_specexpert.quant_config import format_of
from vllm_specexpert.quant_formats import PackedFormat


@dataclass(frozen=True)
class Architecture:
    experts_attr: str
    """Config attribute: routed experts per MoE layer."""
    top_k_attr: str
    """Config attribute: experts per token."""
    vllm_module: str
    """Module of vLLM's implementation (the class is named like the architecture)."""
    intermediate_attr: str = "moe_intermediate_size"
    """Config attribute: one expert's intermediate size."""


SUPPORTED_ARCHITECTURES: dict[str, Architecture] = {
    "Qwen3MoeForCausalLM": Architecture(
        "num_experts", "num_experts_per_tok", "vllm.model_executor.models.qwen3_moe"
    ),
    "Qwen2MoeForCausalLM": Architecture(
        "num_experts", "num_experts_per_tok", "vllm.model_executor.models.qwen2_moe"
    ),
    "MixtralForCausalLM": Architecture(
        "num_local_experts",
        "num_experts_per_tok",
        "vllm.model_executor.models.mixtral",
        "intermediate_size",
    ),
    "OlmoeForCausalLM": Architecture(
        "num_experts",
        "num_experts_per_tok",
        "vllm.model_executor.models.olmoe",
        "intermediate_size",
    ),
    "DeepseekV2ForCausalLM": Architecture(
        "n_routed_experts", "num_experts_per_tok", "vllm.model_executor.models.deepseek_v2"
    ),
    "GptOssForCausalLM": Architecture(
        "num_local_experts",
        "num_experts_per_tok",
        "vllm.model_executor.models.gpt_oss",
        "intermediate_size",
    ),
}


@dataclass(frozen=True)
class MoEShape:
    architecture: str
    num_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Routed experts per token."""


def moe_layer_count(hf_config: Any) -> int:
    """How many decoder layers of the model are MoE layers, by the rule of vLLM's
    implementation (Qwen's ``mlp_only_layers`` and ``decoder_sparse_step``, DeepSeek's
    ``first_k_dense_replace`` and ``moe_layer_freq``; every layer elsewhere)."""
    layers = range(int(hf_config.num_hidden_layers))
    if hasattr(hf_config, "first_k_dense_replace"):
        first = int(hf_config.first_k_dense_replace)
        every = int(getattr(hf_config, "moe_layer_freq", 1))
        return sum(1 for i in layers if i >= first and i % every == 0)
    if hasattr(hf_config, "decoder_sparse_step"):
        dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
        step = int(hf_config.decoder_sparse_step or 1)
        return sum(1 for i in layers if i not in dense and (i + 1) % step == 0)
    return len(layers)


def expert_nbytes(hf_config: Any, dtype_bytes: int) -> int:
    """Bytes of one routed expert's weights (gate, up and down projections) at
    ``dtype_bytes`` per element: the checkpoint's form, a lower bound of a slot's."""
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in SUPPORTED_ARCHITECTURES:
            intermediate = int(getattr(hf_config, SUPPORTED_ARCHITECTURES[arch].intermediate_attr))
            return 3 * int(hf_config.hidden_size) * intermediate * dtype_bytes
    raise ValueError(f"no supported architecture in {hf_config.architectures}")


def moe_shape(hf_config: Any) -> MoEShape:
    """Routing shape of a Hugging Face config, or a clear error if unsupported."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for arch in architectures:
        if arch in SUPPORTED_ARCHITECTURES:
            spec = SUPPORTED_ARCHITECTURES[arch]
            return MoEShape(
                arch,
                int(getattr(hf_config, spec.experts_attr)),
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
                "quantize it first (specexpert quantize), or drop --quantization",
            )
        fmt = format_of(dict(checkpoint))
        if fmt is not None:
            check_packed_tensors(model_config.model, fmt)
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


PACKED_EXPERT_TENSOR = re.compile(
    r"^(.*\.experts\.\d+\.(?:gate_proj|up_proj|down_proj|w1|w2|w3))\.(\w+)$"
)
"""A tensor of one routed expert's projection: (module, tensor name)."""


def check_packed_tensors(model_dir: str, fmt: PackedFormat) -> None:
    """The first quantized expert projection of each kind (gate, up, down) in the
    checkpoint has the tensors ``fmt`` (the ``quantization_config``) gives, with their
    shapes: a group size or format that does not match the tensors is refused from the
    safetensors headers, before anything loads. Skipped for a model that is not a
    local directory (the worker's loader checks every tensor)."""
    import torch
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    modules: dict[str, dict[str, tuple[str, Path]]] = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                match = PACKED_EXPERT_TENSOR.match(key)
                if match and not fmt.skips(match[1]):
                    modules.setdefault(match[1], {})[match[2]] = (key, path)
    checked: set[str] = set()
    for module, names in modules.items():
        kind = module.rpartition(".")[2]
        if kind in checked:
            continue
        checked.add(kind)
        tensors = {}
        for name, (key, path) in names.items():
            with safe_open(str(path), "pt") as f:
                shape = f.get_slice(key).get_shape()
                # Shapes are all a format needs, but a tiny tensor may be read for its
                # values (compressed-tensors' weight_shape).
                tensors[name] = (
                    f.get_tensor(key)
                    if torch.Size(shape).numel() <= 16
                    else torch.empty(shape, device="meta")
                )
        problem = _packed_mismatch(fmt, tensors)
        if problem is not None:
            raise SpecExpertUnsupportedError(
                f"{module} of {model_dir}",
                f"{problem}, where its quantization_config "
                f"({fmt.name}{_group(fmt)}) gives other shapes",
                "use a checkpoint quantized as its config says (or fix its "
                "quantization_config, e.g. the group_size)",
            )


def _group(fmt: PackedFormat) -> str:
    size = getattr(fmt, "group_size", None)
    return f", group_size {size}" if size is not None else ""


def _packed_mismatch(fmt: PackedFormat, tensors: dict) -> str | None:
    """What in ``tensors`` (one projection's) disagrees with ``fmt``, or ``None``."""
    try:
        out_features, in_features = fmt.features(tensors)
    except (KeyError, IndexError, ValueError, RuntimeError) as error:
        return f"lacks the tensors of the format ({type(error).__name__}: {error})"
    for name, (shape, _) in fmt.tensor_shapes(out_features, in_features).items():
        if name not in tensors:
            return f"has no tensor {name}"
        found = tuple(tensors[name].shape)
        if (len(found) == len(shape) and found != tuple(shape)) or math.prod(found) != math.prod(
            shape
        ):
            return f"has {name} of shape {list(found)} (expected {list(shape)})"
    return None
