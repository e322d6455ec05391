"""Write the expert pack of a checkpoint: every routed expert in one expert-major,
4 KiB-aligned file that the disk tier reads whole experts from.

    specexpert pack MODEL --out DIR

``MODEL``: a bf16 (or fp16/fp32) safetensors checkpoint whose experts are stored one
tensor per projection (Qwen2/3-MoE, OLMoE, DeepSeek-V2, Mixtral). ``DIR``: new, empty, or
a pack written before, whole or interrupted (rewritten); apart from ``MODEL``; on a
filesystem with room for the pack (checked before any work); not in use by an engine
(refused, naming its process). ``--verify`` writes nothing: it reads the whole
checkpoint and the whole pack and checks that every record holds its expert.

Experts are read one at a time from the checkpoint and written as they come: memory use
stays at one expert whatever the model's size. Prints what it wrote and how fast.
"""

from __future__ import annotations

import argparse
import sys
import time

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.tiers.pack_lock import PackBusy
from vllm_specexpert.tiers.pack_writer import is_pack_dir, pack_checkpoint, verify_pack
from vllm_specexpert.tools.arguments import (
    UsageError,
    bf16_model_dir,
    check_apart,
    check_output_dir,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=bf16_model_dir, help="checkpoint directory")
    parser.add_argument("--out", required=True, help="pack directory to write")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="write nothing: check every record of the pack at --out against the checkpoint",
    )


def run(args: argparse.Namespace) -> None:
    if args.verify:
        verify(args)
        return
    out = check_output_dir(args.out, "--out", is_pack_dir, "an expert pack")
    check_apart(args.model, out, "--out")
    start = time.perf_counter()
    try:
        manifest = pack_checkpoint(args.model, out, out_field="--out", model_field="model")
    except SpecExpertConfigError as error:  # (checked before anything is written)
        raise UsageError(error.field_name, f"{error.problem}; {error.fix}") from None
    except PackBusy as busy:
        raise UsageError(
            "--out", f"{busy}; stop it first (an engine reading a pack holds it)"
        ) from None
    seconds = time.perf_counter() - start
    experts = sum(layer.num_experts for layer in manifest.layers)
    print(
        f"wrote {out}: {len(manifest.layers)} layers, {experts} experts, "
        f"{manifest.records_bytes / 1e9:.2f} GB in {seconds:.1f} s "
        f"({manifest.records_bytes / seconds / 1e9:.2f} GB/s)"
    )


def verify(args: argparse.Namespace) -> None:
    """Every record of the pack at ``--out`` read and compared with the checkpoint's
    expert; exit 1 naming each one that differs."""
    start = time.perf_counter()
    try:
        pack, problems = verify_pack(args.out, args.model)
    except SpecExpertConfigError as error:
        raise UsageError("--out", f"{error.problem}; {error.fix}") from None
    except PackBusy as busy:
        raise UsageError("--out", f"{busy}; stop it first") from None
    experts = sum(layer.num_experts for layer in pack.manifest.layers)
    for problem in problems:
        print(problem)
    print(
        f"verified {args.out}: {experts - len(problems)} of {experts} experts match "
        f"{args.model} ({time.perf_counter() - start:.1f} s)"
        + ("" if problems else "; the checkpoint's files are recorded as they are now")
    )
    if problems:
        sys.exit(1)
