"""Write the expert pack of a checkpoint: every routed expert in one expert-major,
4 KiB-aligned file that the disk tier reads whole experts from.

    specexpert pack MODEL --out DIR

``MODEL``: a bf16 (or fp16/fp32) safetensors checkpoint whose experts are stored one
tensor per projection (Qwen2/3-MoE, OLMoE, DeepSeek-V2, Mixtral). ``DIR``: new, empty, or
a pack this command wrote before (rewritten); apart from ``MODEL``; on a filesystem with
room for the pack (checked before any work). Experts are read one at a time from the
checkpoint and written as they come: memory use stays at one expert whatever the model's
size. Prints what it wrote and how fast.
"""

from __future__ import annotations

import argparse
import time

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.tiers.expert_pack import PACK_FORMAT, pack_checkpoint
from vllm_specexpert.tools.arguments import (
    UsageError,
    artifact_of,
    bf16_model_dir,
    check_apart,
    check_output_dir,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=bf16_model_dir, help="checkpoint directory")
    parser.add_argument("--out", required=True, help="pack directory to write")


def run(args: argparse.Namespace) -> None:
    out = check_output_dir(args.out, "--out", artifact_of(PACK_FORMAT), "an expert pack")
    check_apart(args.model, out, "--out")
    start = time.perf_counter()
    try:
        manifest = pack_checkpoint(args.model, out, out_field="--out", model_field="model")
    except SpecExpertConfigError as error:  # (checked before anything is written)
        raise UsageError(error.field_name, f"{error.problem}; {error.fix}") from None
    seconds = time.perf_counter() - start
    experts = sum(layer.num_experts for layer in manifest.layers)
    print(
        f"wrote {out}: {len(manifest.layers)} layers, {experts} experts, "
        f"{manifest.records_bytes / 1e9:.2f} GB in {seconds:.1f} s "
        f"({manifest.records_bytes / seconds / 1e9:.2f} GB/s)"
    )
