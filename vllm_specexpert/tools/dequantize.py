"""Write a quantized checkpoint's bf16 twin: every packed tensor dequantized.

    specexpert dequantize MODEL OUT

The dequantize is the offloaded layer's own (:mod:`vllm_specexpert.quant_formats`: one
rounding, ``(q - z) * s`` in fp32 to bf16), so vanilla vLLM on the twin computes what the
plugin computes on the quantized checkpoint: the reference where vanilla vLLM cannot run
the quantized model itself.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from vllm_specexpert.quant_formats import format_of
from vllm_specexpert.tools.quantize import read_checkpoint, write_checkpoint


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
    write_checkpoint(model, out, result, None)
    return {"format": fmt.name, "dequantized": dequantized, "out": str(out)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, help="quantized checkpoint directory")
    parser.add_argument("out", type=Path, help="output directory for the bf16 twin")


def run(args: argparse.Namespace) -> None:
    print(json.dumps(dequantize_checkpoint(args.model, args.out)))
