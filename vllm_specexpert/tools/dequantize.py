"""Write a quantized checkpoint's bf16 twin: every packed tensor dequantized.

    specexpert dequantize MODEL OUT

The dequantize is the offloaded layer's own (:mod:`vllm_specexpert.quant_formats`: one
rounding, ``(q - z) * s`` in fp32 to bf16), so vanilla vLLM on the twin computes what the
plugin computes on the quantized checkpoint: the reference where vanilla vLLM cannot run
the quantized model itself. The twin's routers are the quantized checkpoint's, so what the
transformers-based tools (calibrate, analyze, train-estimator, ...) make for the twin has
the quantized model's fingerprint and is accepted for it.

``MODEL``'s safetensors files are checked complete (from their headers), and ``OUT`` (new,
empty, or a twin this command wrote before; apart from ``MODEL``), before any work.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from vllm_specexpert.quant_config import format_of
from vllm_specexpert.tools.arguments import quantized_model_dir
from vllm_specexpert.tools.quantize import (
    check_checkpoint_out,
    read_checkpoint,
    write_checkpoint,
)


def dequantize_checkpoint(model: Path, out: Path) -> dict:
    config = json.loads((model / "config.json").read_text())
    fmt = format_of(config.get("quantization_config"))
    if fmt is None:
        raise SystemExit(f"specexpert dequantize: {model} has no quantization_config")
    tensors = read_checkpoint(model)
    modules: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for name, tensor in tensors.items():
        prefix, _, key = name.rpartition(".")
        modules[prefix][key] = tensor
    result: dict[str, torch.Tensor] = {}
    dequantized = 0
    for prefix, parts in modules.items():
        probe = fmt.tensor_shapes(8 * 128, 8 * 128)  # the names only
        if not set(probe) <= set(parts):
            result.update({f"{prefix}.{k}": t for k, t in parts.items()})
            continue
        out_features, in_features = fmt.features(parts)
        packed = {k: parts.pop(k) for k in probe}
        result[f"{prefix}.weight"] = fmt.dequantize(packed, out_features, in_features)
        # Other quantization metadata (GPTQ's g_idx) goes; a bias stays.
        result.update({f"{prefix}.{k}": t for k, t in parts.items() if k == "bias"})
        dequantized += 1
    write_checkpoint(
        model, out, result, None, {"made_by": "specexpert dequantize", "format": fmt.name}
    )
    return {"format": fmt.name, "dequantized": dequantized, "out": str(out)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=quantized_model_dir, help="quantized checkpoint directory")
    parser.add_argument("out", type=Path, help="output directory for the bf16 twin")


def run(args: argparse.Namespace) -> None:
    check_checkpoint_out(Path(args.model), args.out, "dequantize")
    print(json.dumps(dequantize_checkpoint(Path(args.model), args.out)))
