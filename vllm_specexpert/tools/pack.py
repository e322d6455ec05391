"""Write the expert pack of a checkpoint: every routed expert in one file, in the form the
expert kernel reads (on the CPU build, this machine's prepacked layout), that the disk
tier reads experts from.

    specexpert pack MODEL --out DIR [--dtype DTYPE] [--isa vec|amx] [--draft]

``MODEL``: a bf16 (or fp16/fp32) safetensors checkpoint whose experts are stored one
tensor per projection (Qwen2/3-MoE, OLMoE, DeepSeek-V2, Mixtral). ``DIR``: new, empty, or
a pack written before, whole or interrupted (rewritten); apart from ``MODEL``; on a
filesystem with room for the pack (checked before any work); not in use by an engine
(refused, naming its process). ``--dtype``: the dtype the model is served in (default:
the checkpoint's). ``--isa``: the CPU kernel's layout for another machine (default: this
machine's; an engine refuses a pack of another ISA). ``--draft``: also the ``lookahead``
draft's INT4 experts, after the target's (about 0.28x their bytes; a pack without them
is refused by an engine with ``lookahead``). ``--verify`` reads the whole
checkpoint and the whole pack and checks that every expert is there; it writes only the
manifest: the checkpoint as it is now when all match, else the failure (an engine's start
then refuses the pack until it is made again or verified whole).

Experts are read one at a time from the checkpoint and written as they come: memory use
stays at one expert whatever the model's size. Prints what it wrote and how fast.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.layers.int4_copies import Int4DraftForm
from vllm_specexpert.tiers.kernel_form import DTYPES, KernelForm, model_kernel_form
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
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        help="the dtype the model is served in (default: the checkpoint's)",
    )
    parser.add_argument(
        "--isa",
        choices=["vec", "amx"],
        help="the CPU kernel's layout to write (default: this machine's)",
    )
    parser.add_argument(
        "--draft",
        action="store_true",
        help="also write the lookahead draft's INT4 experts (needed by an engine with lookahead)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="check every record of the pack at --out against the checkpoint (a failure is "
        "recorded: engines refuse the pack until it is made again or verified whole)",
    )


def run(args: argparse.Namespace) -> None:
    if args.verify:
        verify(args)
        return
    out = check_output_dir(args.out, "--out", is_pack_dir, "an expert pack")
    check_apart(args.model, out, "--out")
    start = time.perf_counter()
    try:
        manifest = pack_checkpoint(
            args.model,
            out,
            form_of(args),
            out_field="--out",
            model_field="model",
            draft=draft_form_of(args),
        )
    except SpecExpertConfigError as error:  # (checked before anything is written)
        raise UsageError(error.field_name, f"{error.problem}; {error.fix}") from None
    except PackBusy as busy:
        raise UsageError(
            "--out", f"{busy}; stop it first (an engine reading a pack holds it)"
        ) from None
    seconds = time.perf_counter() - start
    experts = sum(layer.num_experts for layer in manifest.layers)
    drafts = f" (and the draft's {len(manifest.draft_layers)})" if manifest.draft_layers else ""
    print(
        f"wrote {out}: {len(manifest.layers)} layers{drafts}, {experts} experts, "
        f"{manifest.records_bytes / 1e9:.2f} GB in {seconds:.1f} s "
        f"({manifest.records_bytes / seconds / 1e9:.2f} GB/s)"
    )


def form_of(args: argparse.Namespace) -> KernelForm:
    """The form to write: the kernel's on this build, for the dtype asked or the
    checkpoint's."""
    from vllm.platforms import current_platform

    name = args.dtype
    if name is None:
        config = json.loads(Path(args.model, "config.json").read_text())
        name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return model_kernel_form(getattr(torch, name), current_platform.is_cpu(), args.isa)


def draft_form_of(args: argparse.Namespace) -> Int4DraftForm | None:
    """The draft's form when ``--draft`` (or ``--verify``, which checks a pack's draft
    regions if it has them), in the form's dtype."""
    if not (args.draft or args.verify):
        return None
    return Int4DraftForm(DTYPES[form_of(args).dtype])


def verify(args: argparse.Namespace) -> None:
    """Every record of the pack at ``--out`` read and compared with the checkpoint's
    expert; exit 1 naming each one that differs."""
    start = time.perf_counter()
    try:
        pack, problems = verify_pack(args.out, args.model, form_of(args), draft_form_of(args))
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
