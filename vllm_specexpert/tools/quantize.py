"""Quantize a bf16 MoE checkpoint's routed experts (AWQ, GPTQ, compressed-tensors W4A16, FP8).

    specexpert quantize MODEL OUT --format awq|gptq|w4a16|fp8 [--group-size 128]
                        [--fp8-scales tensor|channel|block] [--fp8-block 128 128]

Round-to-nearest, experts only: attention, routers, shared experts and the LM head stay
bf16 and are listed as unquantized in ``quantization_config`` (so vLLM runs them as
before, and a checkpoint's bf16 twin from ``specexpert dequantize`` differs from it in
the experts only). The packing is :mod:`vllm_specexpert.quant_formats`'s.

``MODEL`` is a bf16 checkpoint; ``OUT`` is new, empty, or a checkpoint this command wrote
before (its :data:`STAMP` says so), apart from ``MODEL``. The group size is checked
against every expert's shape (read from the safetensors headers) before any tensor is read.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch

from vllm_specexpert.quant_formats import (
    SUPPORTED_GROUP_SIZES,
    AwqFormat,
    Fp8Format,
    GptqFormat,
    PackedFormat,
    PackQuantizedFormat,
)
from vllm_specexpert.tools.arguments import (
    UsageError,
    bf16_model_dir,
    check_apart,
    check_output_dir,
    positive_int,
)
from vllm_specexpert.tools.provenance import model_label

EXPERT_WEIGHT = re.compile(r"(.*\.experts\.\d+\.(?:gate_proj|up_proj|down_proj|w1|w2|w3))\.weight$")
"""A routed expert's projection in a per-expert checkpoint (Qwen/DeepSeek/OLMoE: gate/up/down;
Mixtral: w1/w3/w2)."""

FORMATS = ("awq", "gptq", "w4a16", "fp8")
STAMP = "specexpert-checkpoint.json"
"""What ``quantize`` and ``dequantize`` write beside a checkpoint: ``{"made_by", "from",
"format"}``; an ``OUT`` holding it from the same command may be written again."""


def make_format(
    name: str,
    group_size: int = 128,
    fp8_scales: str = "tensor",
    fp8_block: tuple[int, int] = (128, 128),
) -> PackedFormat:
    if name == "awq":
        return AwqFormat("awq", (), group_size)
    if name == "gptq":
        return GptqFormat("gptq", (), group_size)
    if name == "w4a16":
        return PackQuantizedFormat("pack-quantized", (), group_size)
    return Fp8Format("fp8", (), scales=fp8_scales, block=tuple(fp8_block))


def quantization_config(fmt: PackedFormat, unquantized: list[str]) -> dict:
    """``quantization_config`` as vLLM (and the format's own tooling) reads it; the
    ``unquantized`` modules (full checkpoint names) are left out."""
    if isinstance(fmt, AwqFormat):
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": fmt.group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": unquantized,
        }
    if isinstance(fmt, GptqFormat):
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": fmt.group_size,
            "sym": fmt.symmetric,
            "desc_act": False,
            "checkpoint_format": "gptq",
            "lm_head": False,
        }
    if isinstance(fmt, Fp8Format) and fmt.scales != "channel":
        config = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "ignored_layers": unquantized,
        }
        if fmt.scales == "block":
            config["weight_block_size"] = list(fmt.block)
        return config
    if isinstance(fmt, Fp8Format):
        weights = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": "channel",
            "dynamic": False,
        }
        kind = "float-quantized"
    else:
        weights = {
            "num_bits": 4,
            "type": "int",
            "symmetric": fmt.symmetric,
            "strategy": "group" if fmt.group_size != -1 else "channel",
            "group_size": None if fmt.group_size == -1 else fmt.group_size,
            "dynamic": False,
        }
        kind = "pack-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": kind,
        "quantization_status": "compressed",
        "ignore": unquantized,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": kind,
            }
        },
    }


def read_checkpoint(model: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    if not tensors:
        raise SystemExit(f"specexpert: no *.safetensors in {model}")
    return tensors


def written_by(command: str):
    """Whether a directory holds a checkpoint ``specexpert COMMAND`` wrote (its stamp)."""

    def check(path: Path) -> bool:
        try:
            return json.loads((path / STAMP).read_text()).get("made_by") == f"specexpert {command}"
        except (OSError, ValueError, AttributeError):
            return False

    return check


def check_checkpoint_out(model: Path, out: Path, command: str) -> None:
    """``OUT`` of ``quantize``/``dequantize``: apart from ``MODEL``, and new, empty or
    written by the same command before."""
    check_apart(model, out, "out")
    check_output_dir(out, "out", written_by(command), f"a checkpoint of `specexpert {command}`")


def copy_model_files(model: Path, out: Path) -> None:
    """``model``'s files besides its weights, config and stamps (tokenizer, generation
    config, ...) into ``out`` (made if absent): what a rewritten checkpoint keeps."""
    out.mkdir(parents=True, exist_ok=True)
    for path in model.iterdir():
        if (
            path.is_file()
            and path.suffix != ".safetensors"
            and path.name
            not in ("config.json", "model.safetensors.index.json", "fixture.json", STAMP)
        ):
            shutil.copy2(path, out / path.name)


def write_checkpoint(
    model: Path, out: Path, tensors: dict[str, torch.Tensor], quantization: dict | None, stamp: dict
) -> None:
    """``out``: ``model``'s files (tokenizer, generation config, ...) with these tensors,
    ``quantization_config`` (``None``: none) and the :data:`STAMP` ``stamp``."""
    from safetensors.torch import save_file

    copy_model_files(model, out)
    config = json.loads((model / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization is not None:
        config["quantization_config"] = quantization
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(
        {k: t.contiguous() for k, t in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / STAMP).write_text(json.dumps({**stamp, "from": model_label(model)}, indent=1))


def check_quantizable(model: Path, fmt: PackedFormat) -> int:
    """The number of routed-expert projections of ``model`` that ``fmt`` quantizes, from
    the safetensors headers (no tensor read): a group size that does not divide one's
    input features, or none at all, is a :class:`UsageError`."""
    from safetensors import safe_open

    size = getattr(fmt, "group_size", -1)
    experts = 0
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if EXPERT_WEIGHT.match(name) is None:
                    continue
                in_features = f.get_slice(name).get_shape()[-1]
                if size != -1 and in_features % size:
                    raise UsageError(
                        "--group-size",
                        f"{name} has {in_features} input features, "
                        f"not a multiple of --group-size {size}; pick one that "
                        "divides it",
                    )
                experts += 1
    if not experts:
        raise UsageError(
            "model",
            f"{model} has no per-expert projection weights "
            "(experts.N.gate_proj/up_proj/down_proj or w1/w2/w3)",
        )
    return experts


def quantize_checkpoint(model: Path, out: Path, fmt: PackedFormat, kind: str) -> dict:
    """Write ``model`` with its routed experts quantized in ``fmt``; returns a summary.
    What :func:`check_quantizable` refuses is a ``SystemExit`` naming it."""
    try:
        check_quantizable(model, fmt)
    except UsageError as error:
        raise SystemExit(f"specexpert quantize: {error}") from None
    tensors = read_checkpoint(model)
    result: dict[str, torch.Tensor] = {}
    unquantized: set[str] = {"lm_head"}
    experts = 0
    for name, tensor in tensors.items():
        match = EXPERT_WEIGHT.match(name)
        if match is None:
            if name.endswith(".weight") and tensor.dim() == 2 and "embed" not in name:
                unquantized.add(name.removesuffix(".weight"))
            result[name] = tensor
            continue
        for key, packed in fmt.quantize(tensor).items():
            result[f"{match.group(1)}.{key}"] = packed
        experts += 1
    write_checkpoint(
        model,
        out,
        result,
        quantization_config(fmt, sorted(unquantized)),
        {"made_by": "specexpert quantize", "format": kind},
    )
    return {"format": kind, "projections": experts, "out": str(out)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=bf16_model_dir, help="bf16 checkpoint directory")
    parser.add_argument("out", type=Path, help="output directory")
    parser.add_argument("--format", choices=FORMATS, required=True)
    parser.add_argument(
        "--group-size",
        type=int,
        choices=SUPPORTED_GROUP_SIZES,
        default=None,
        help="INT4 group size (32, 64, 128, or -1 for one per channel; default 128)",
    )
    parser.add_argument(
        "--fp8-scales",
        choices=("tensor", "channel", "block"),
        default=None,
        help="FP8 scales (default: tensor)",
    )
    parser.add_argument(
        "--fp8-block",
        type=positive_int,
        nargs=2,
        default=None,
        metavar=("OUT", "IN"),
        help="block shape [out, in] of --fp8-scales block (default 128 128)",
    )


def run(args: argparse.Namespace) -> None:
    model = Path(args.model)
    if args.format == "fp8" and args.group_size is not None:
        raise UsageError("--group-size", "sets an INT4 group size; --format fp8 has none")
    if args.format != "fp8" and args.fp8_scales is not None:
        raise UsageError("--fp8-scales", f"sets FP8 scales; --format {args.format} is INT4")
    if args.fp8_block is not None and args.fp8_scales != "block":
        raise UsageError("--fp8-block", "sets the block of --fp8-scales block")
    check_checkpoint_out(model, args.out, "quantize")
    fmt = make_format(
        args.format,
        128 if args.group_size is None else args.group_size,
        args.fp8_scales or "tensor",
        tuple(args.fp8_block or (128, 128)),
    )
    check_quantizable(model, fmt)
    print(json.dumps(quantize_checkpoint(model, args.out, fmt, args.format)))
