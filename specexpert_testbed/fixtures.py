"""Named test models: the embedded trained model by name, and tiny random-weight MoE
models of every supported architecture (with quantized and widened variants).

    python -m specexpert_testbed.fixtures [--out DIR] [--arch NAME ...]   (from the repository)

Each model is a Hugging Face checkpoint directory (config.json, bf16 safetensors, the
embedded model's tokenizer) that vLLM and transformers load natively. Weights come from a
fixed seed, so the same command rebuilds the same bytes; ``--retrain-tokenizer`` rebuilds
the shared tokenizer (:mod:`vllm_specexpert.tools.embedded_model`). Models are cached
under ``$SPECEXPERT_CACHE`` (default ``~/.cache/vllm-specexpert``) and rebuilt when this
file, the embedded model's module or the tokenizer change."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

from vllm_specexpert.tools import embedded_model
from vllm_specexpert.tools.embedded_model import (
    TOKENIZER_JSON,
    TRAINED_MODEL_DIR,
    VOCAB_SIZE,
    save_tokenizer,
    train_tokenizer,
)

TRAINED_MODEL = "trained"
"""Name of the embedded model trained by ``specexpert train-tiny`` (a Qwen3-MoE)."""
DEFAULT_OUT = (
    Path(os.environ.get("SPECEXPERT_CACHE", Path.home() / ".cache" / "vllm-specexpert"))
    / "fixtures"
)
DEFAULT_MODEL = TRAINED_MODEL
"""The model of the benchmarks when none is given."""
SEED = 1234

# Shared shape: small enough to start in seconds, aligned for vLLM's CPU MoE kernel
# (hidden and intermediate sizes divisible by 32).
COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "initializer_range": 0.05,
}

ARCHITECTURES: dict[str, dict] = {
    # Fine-grained, Qwen3-30B-A3B-like routing: 16 experts, top-4.
    "qwen3_moe": {
        "cls": "Qwen3MoeConfig",
        "head_dim": 32,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    # Mixtral-like: 8 large experts, top-2.
    "mixtral": {
        "cls": "MixtralConfig",
        "intermediate_size": 128,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    # OLMoE-like: 16 experts, top-2, no renormalization of the top-k weights.
    "olmoe": {
        "cls": "OlmoeConfig",
        "intermediate_size": 64,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
    },
    # Qwen2-MoE-like: routed experts plus a gated shared expert that stays resident.
    "qwen2_moe": {
        "cls": "Qwen2MoeConfig",
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    # DeepSeek-V2-Lite-like: MLA attention, a dense first layer, 2 shared experts.
    "deepseek_v2": {
        "cls": "DeepseekV2Config",
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "n_routed_experts": 16,
        "n_shared_experts": 2,
        "num_experts_per_tok": 2,
        # vLLM's CPU MLA kernel only compiles kv_lora_rank + rope = 512 + 64.
        "first_k_dense_replace": 1,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64,
        "v_head_dim": 32,
        "head_dim": 64,
        "topk_method": "greedy",
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
    },
    # GPT-OSS-like: expert biases, SWIGLUOAI (clamped), a biased router, attention sinks
    # and alternating sliding-window layers. Fused [E, ...] expert tensors on disk.
    "gpt_oss": {
        "cls": "GptOssConfig",
        "head_dim": 32,
        "intermediate_size": 64,
        "num_local_experts": 16,
        "num_experts_per_tok": 4,
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "random_biases": True,
    },
}

DENSE_ARCHITECTURES: dict[str, dict] = {
    # A dense model, for the "unsupported model" error path.
    "qwen3_dense": {"cls": "Qwen3Config", "head_dim": 32, "intermediate_size": 256},
}
ALL_FIXTURES = {**ARCHITECTURES, **DENSE_ARCHITECTURES}

QUANTIZED_FIXTURES: dict[str, dict] = {
    # The qwen3_moe fixture's experts quantized by `specexpert quantize` (group size 32:
    # the down projection has 64 input features). Each has a bf16 twin, NAME + "-twin".
    "qwen3_moe-awq": {"name": "awq", "group_size": 32},
    "qwen3_moe-gptq": {"name": "gptq", "group_size": 32},
    "qwen3_moe-w4a16": {"name": "w4a16", "group_size": 32},
    "qwen3_moe-fp8": {"name": "fp8", "fp8_scales": "tensor"},
    "qwen3_moe-fp8-channel": {"name": "fp8", "fp8_scales": "channel"},
    "qwen3_moe-fp8-block": {"name": "fp8", "fp8_scales": "block", "fp8_block": (32, 32)},
}
TWIN_SUFFIX = "-twin"

WIDENED_FIXTURES: dict[str, int] = {
    # The embedded trained model with its experts widened (`specexpert widen`): its
    # routing, 2.5x its expert bytes, an intermediate size the CPU kernel pads (160).
    "tiny-wide": 160,
}
"""Name -> the new intermediate size."""


def model_path(name: str) -> Path:
    """Directory of a named model: the embedded trained model, a random fixture, or a
    quantized fixture or its bf16 twin (built on first use)."""
    if name == TRAINED_MODEL:
        return TRAINED_MODEL_DIR
    if name.removesuffix(TWIN_SUFFIX) in QUANTIZED_FIXTURES:
        return ensure_quantized(name)
    if name in WIDENED_FIXTURES:
        return ensure_widened(name)
    return ensure_model(name)


def ensure_widened(name: str, out: Path = DEFAULT_OUT) -> Path:
    """A widened fixture of the trained model, rebuilt when the model or the tool
    changes."""
    from vllm_specexpert.tools import widen

    with open(TRAINED_MODEL_DIR / "model.safetensors", "rb") as f:
        h = hashlib.sha256(f.read(1 << 20))
    h.update(Path(widen.__file__).read_bytes())
    h.update(str(WIDENED_FIXTURES[name]).encode())
    fingerprint = h.hexdigest()[:16]
    target = out / name
    stamp = target / "fixture.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("fingerprint") == fingerprint:
        return target
    widen.widen_checkpoint(TRAINED_MODEL_DIR, target, WIDENED_FIXTURES[name])
    stamp.write_text(json.dumps({"fingerprint": fingerprint, "arch": name}))
    return target


def ensure_quantized(name: str, out: Path = DEFAULT_OUT) -> Path:
    """A quantized fixture (``specexpert quantize`` of its base) or its bf16 twin
    (``specexpert dequantize`` of it), rebuilt when the base or the tools change."""
    from vllm_specexpert import quant_formats
    from vllm_specexpert.tools import dequantize, quantize

    quantized = name.removesuffix(TWIN_SUFFIX)
    base = ensure_model(quantized.split("-")[0])
    h = hashlib.sha256((base / "fixture.json").read_bytes())
    for module in (quant_formats, quantize, dequantize):
        h.update(Path(module.__file__).read_bytes())
    h.update(json.dumps(QUANTIZED_FIXTURES[quantized]).encode())
    fingerprint = h.hexdigest()[:16]
    target = out / name
    stamp = target / "fixture.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("fingerprint") == fingerprint:
        return target
    if name == quantized:
        fmt = quantize.make_format(**QUANTIZED_FIXTURES[quantized])
        quantize.quantize_checkpoint(base, target, fmt, QUANTIZED_FIXTURES[quantized]["name"])
    else:
        dequantize.dequantize_checkpoint(ensure_quantized(quantized, out), target)
    stamp.write_text(json.dumps({"fingerprint": fingerprint, "arch": name}))
    return target


def num_moe_layers(name: str) -> int:
    if name == TRAINED_MODEL or name in WIDENED_FIXTURES:
        return json.loads((TRAINED_MODEL_DIR / "config.json").read_text())["num_hidden_layers"]
    spec = ARCHITECTURES[name]
    return COMMON["num_hidden_layers"] - spec.get("first_k_dense_replace", 0)


def build_model(arch: str, out: Path) -> Path:
    import torch
    import transformers

    spec = dict(ALL_FIXTURES[arch])
    config_cls = getattr(transformers, spec.pop("cls"))
    random_biases = spec.pop("random_biases", False)
    config = config_cls(**COMMON, **spec, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    config.dtype = "bfloat16"
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if random_biases:  # initialized to zeros: a bias taken from the wrong expert would not show
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias") or name.endswith("_bias"):
                    param.normal_(0.0, config.initializer_range)
    model = model.to(torch.bfloat16)
    target = out / arch
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(target), safe_serialization=True)
    save_tokenizer(target)
    return target


def fixture_fingerprint(arch: str) -> str:
    """Changes when the builder, its shapes or the tokenizer change."""
    h = hashlib.sha256()
    for source in (__file__, embedded_model.__file__):
        h.update(Path(source).read_bytes())
    h.update(TOKENIZER_JSON.read_bytes())
    h.update(arch.encode())
    return h.hexdigest()[:16]


def ensure_model(arch: str, out: Path = DEFAULT_OUT) -> Path:
    """Path of the fixture model ``arch``, building it if missing or stale."""
    target = out / arch
    stamp = target / "fixture.json"
    fingerprint = fixture_fingerprint(arch)
    if stamp.exists() and json.loads(stamp.read_text()).get("fingerprint") == fingerprint:
        return target
    build_model(arch, out)
    stamp.write_text(json.dumps({"fingerprint": fingerprint, "arch": arch}))
    return target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--arch", nargs="*", default=list(ALL_FIXTURES), choices=list(ALL_FIXTURES))
    parser.add_argument("--retrain-tokenizer", action="store_true")


def run(args: argparse.Namespace) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.retrain_tokenizer or not TOKENIZER_JSON.exists():
        train_tokenizer(TOKENIZER_JSON)
        print(f"tokenizer -> {TOKENIZER_JSON}")
    for arch in args.arch:
        print(f"{arch} -> {ensure_model(arch, args.out)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    run(parser.parse_args())
