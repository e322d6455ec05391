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
import shutil
import time

from vllm_specexpert.artifacts import model_fingerprint
from vllm_specexpert.tiers.checkpoint_experts import CheckpointExperts
from vllm_specexpert.tiers.disk_reader import aligned
from vllm_specexpert.tiers.expert_pack import (
    PACK_FORMAT,
    checkpoint_files,
    write_pack,
)
from vllm_specexpert.tools.arguments import (
    UsageError,
    artifact_of,
    bf16_model_dir,
    check_apart,
    check_output_dir,
    existing_ancestor,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=bf16_model_dir, help="checkpoint directory")
    parser.add_argument("--out", required=True, help="pack directory to write")


def run(args: argparse.Namespace) -> None:
    out = check_output_dir(args.out, "--out", artifact_of(PACK_FORMAT), "an expert pack")
    check_apart(args.model, out, "--out")
    try:
        source = CheckpointExperts(args.model)
    except ValueError as error:
        raise UsageError("model", str(error)) from None
    layers = source.layers()
    if not layers:
        raise UsageError("model", f"{args.model}: no routed expert tensors found")
    need = sum(count * aligned(source.expert_nbytes(name)) for name, count in layers)
    existing = out / "experts.bin"
    have = shutil.disk_usage(existing_ancestor(out)).free
    have += existing.stat().st_size if existing.exists() else 0
    if need > have:
        raise UsageError(
            "--out",
            f"the pack needs {need / 1e9:.2f} GB, {existing_ancestor(out)} has "
            f"{have / 1e9:.2f} GB free; give a directory on a disk with room",
        )
    start = time.perf_counter()
    manifest = write_pack(
        out,
        layers,
        source,
        {
            "model": str(args.model),
            "model_fingerprint": model_fingerprint(args.model),
            "checkpoint_files": checkpoint_files(args.model),
        },
    )
    seconds = time.perf_counter() - start
    experts = sum(layer.num_experts for layer in manifest.layers)
    print(
        f"wrote {out}: {len(manifest.layers)} layers, {experts} experts, "
        f"{manifest.records_bytes / 1e9:.2f} GB in {seconds:.1f} s "
        f"({manifest.records_bytes / seconds / 1e9:.2f} GB/s)"
    )
