"""Widen a bf16 MoE checkpoint's routed experts: the same model, bigger experts.

    specexpert widen MODEL OUT (--intermediate N | --expert-mib M) [--shard-gib 4]
                               [--carry ARTIFACT_DIR ...]

Each routed expert's intermediate dimension grows from ``I`` to ``N`` (or to what makes
one expert weigh ``M`` MiB) with zero rows in its gate and up projections and zero
columns in its down projection. A zero row gives a zero activation (``silu(0) * 0``),
and a zero column multiplies it, so every expert computes the function it computed
before, up to the order a kernel sums in; the routers, attention and everything else
are copied unchanged, so the routing is the trained model's. What changes is what the
experts weigh: their bytes to store, read and multiply are those of a large model's
(Qwen3-30B-A3B's experts are 9.0 MiB in bf16, Mixtral-8x7B's 336 MiB).

Written as it is read: one tensor at a time, into safetensors shards of at most
``--shard-gib`` GiB with a ``model.safetensors.index.json``, so memory stays at one
tensor whatever the size. ``OUT``: new, empty, or written by this command before; apart
from ``MODEL``; with room for the result (checked before any work).

``--carry``: artifact directories made for ``MODEL`` (calibration, estimator, path
predictor) copied to ``OUT/artifacts/<name>`` and stamped for the widened model. What
they hold (routes, router inputs, predictors of them) widening leaves as it was; each is
checked to have been made for ``MODEL`` first, so that a stale one is not carried.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from vllm_specexpert.tools.arguments import (
    UsageError,
    bf16_model_dir,
    existing_ancestor,
    positive_float,
    positive_int,
)
from vllm_specexpert.tools.quantize import (
    EXPERT_WEIGHT,
    STAMP,
    check_checkpoint_out,
    copy_model_files,
)

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
INTERMEDIATE_KEYS = ("moe_intermediate_size",)
"""config.json keys holding the routed experts' intermediate size (Mixtral's experts use
``intermediate_size``, which it has no other use for)."""
DOWN = ("down_proj", "w2")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=bf16_model_dir, help="bf16 checkpoint directory")
    parser.add_argument("out", help="directory to write the widened checkpoint to")
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--intermediate", type=positive_int, help="new intermediate size")
    size.add_argument("--expert-mib", type=positive_float, help="new size of one expert")
    parser.add_argument("--shard-gib", type=positive_float, default=4.0)
    parser.add_argument(
        "--carry",
        nargs="+",
        default=[],
        metavar="ARTIFACT_DIR",
        help="artifact directories made for MODEL to copy for the widened model",
    )


def run(args: argparse.Namespace) -> None:
    model, out = Path(args.model), Path(args.out)
    check_checkpoint_out(model, out, "widen")
    carried = [Path(d) for d in args.carry]
    _check_carried(model, carried)
    widen_checkpoint(model, out, args.intermediate, args.expert_mib, int(args.shard_gib * 2**30))
    for path in carry_artifacts(model, out, carried):
        print(f"carried {path}")


def widen_checkpoint(
    model: Path,
    out: Path,
    intermediate: int | None = None,
    expert_mib: float | None = None,
    shard_bytes: int = 4 << 30,
) -> None:
    """Write ``model`` with its experts widened to ``intermediate`` (or to ``expert_mib``
    MiB each) to ``out`` (module doc); a ``UsageError`` before any work for what cannot
    be done."""
    config = json.loads((model / "config.json").read_text())
    key = _intermediate_key(config)
    old = int(config[key])
    plan = _plan(model)
    experts = [name for name in plan if EXPERT_WEIGHT.match(name)]
    if not experts:
        raise UsageError("model", f"{model}: no routed expert projections found")
    hidden = int(config["hidden_size"])
    itemsize = torch.tensor([], dtype=plan[experts[0]][1]).element_size()
    if intermediate is not None:
        new = intermediate
    elif expert_mib is not None:
        new = max(1, round(expert_mib * 2**20 / (3 * hidden * itemsize)))
    else:
        raise UsageError("--intermediate", "give the new intermediate size or --expert-mib")
    if new < old:
        raise UsageError("--intermediate", f"{new} is below the model's intermediate size {old}")
    widened = {
        name: (_widened(name, shape, old, new), dtype)
        if EXPERT_WEIGHT.match(name)
        else (shape, dtype)
        for name, (shape, dtype) in plan.items()
    }
    total = sum(
        math.prod(s) * torch.tensor([], dtype=d).element_size() for s, d in widened.values()
    )
    free = shutil.disk_usage(existing_ancestor(out)).free
    if total > free:
        raise UsageError(
            "out", f"the widened checkpoint needs {total / 1e9:.2f} GB, {free / 1e9:.2f} GB free"
        )
    copy_model_files(model, out)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    shards = _shards(widened, shard_bytes)
    weight_map = {}
    sources = {name: file for file, names in _where(model).items() for name in names}
    handles = {file: safe_open(str(model / file), "pt") for file in set(sources.values())}
    for index, names in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(
            out / file,
            {name: widened[name] for name in names},
            lambda name: handles[sources[name]].get_tensor(name),
        )
        weight_map.update(dict.fromkeys(names, file))
        print(f"wrote {file} ({len(names)} tensors)", flush=True)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    config[key] = new
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "README.md").write_text(
        f"# {out.name}: {model.name} with widened experts\n\n"
        f"Made by `specexpert widen` from {model}: every routed expert's intermediate size "
        f"grown from {old} to {new} with zero rows (gate, up) and zero columns (down). The "
        "experts compute what they computed before and the routing is the trained model's; "
        "their bytes, to store, read and multiply, are those of a larger model's. Not a "
        "model to use for its text: a model to measure offloading on.\n"
    )
    (out / STAMP).write_text(
        json.dumps({"made_by": "specexpert widen", "from": str(model), "intermediate": new})
    )
    expert_mib = 3 * hidden * new * itemsize / 2**20
    print(
        f"wrote {out}: {len(experts) // 3} experts of {expert_mib:.2f} MiB "
        f"(intermediate {old} -> {new}), {total / 1e9:.2f} GB in {len(shards)} shard(s)"
    )


def carry_artifacts(model: Path, out: Path, artifacts: list[Path]) -> list[Path]:
    """Each artifact directory (made for ``model``) copied to ``out/artifacts/<name>``
    with its manifest stamped for ``out``, the widened ``model``; the copies."""
    from vllm_specexpert.artifacts import model_fingerprint

    _check_carried(model, artifacts)
    fingerprint = model_fingerprint(out) if artifacts else {}
    copies = []
    for source in artifacts:
        target = out / "artifacts" / source.name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target)
        manifest = json.loads((target / "manifest.json").read_text())
        manifest.update(
            model=str(out),
            model_fingerprint=fingerprint,
            widened_from={"model": str(model), "artifact": str(source)},
        )
        (target / "manifest.json").write_text(json.dumps(manifest, indent=1))
        copies.append(target)
    return copies


def _check_carried(model: Path, artifacts: list[Path]) -> None:
    from vllm_specexpert.artifacts import model_fingerprint

    expected = model_fingerprint(model) if artifacts else {}
    for source in artifacts:
        path = source / "manifest.json"
        try:
            made_for = json.loads(path.read_text()).get("model_fingerprint")
        except (OSError, ValueError, AttributeError) as exc:
            raise UsageError("--carry", f"{path}: not an artifact's manifest ({exc})") from None
        if made_for != expected:
            raise UsageError(
                "--carry", f"{source} was not made for {model} (its model_fingerprint differs)"
            )


def _intermediate_key(config: dict) -> str:
    for key in INTERMEDIATE_KEYS:
        if key in config:
            return key
    if "MixtralForCausalLM" in (config.get("architectures") or []):
        return "intermediate_size"
    raise UsageError("model", "config.json names no routed experts' intermediate size")


def _where(model: Path) -> dict[str, list[str]]:
    found = {}
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            found[path.name] = list(f.keys())
    return found


def _plan(model: Path) -> dict[str, tuple[list[int], torch.dtype]]:
    """Every tensor's shape and dtype, from the headers."""
    plan = {}
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                part = f.get_slice(name)
                dtype = part.get_dtype()
                if dtype not in DTYPES:
                    raise UsageError("model", f"{name}: dtype {dtype} (bf16/fp16/fp32 only)")
                plan[name] = (list(part.get_shape()), DTYPES[dtype])
    return plan


def _widened(name: str, shape: list[int], old: int, new: int) -> list[int]:
    match = EXPERT_WEIGHT.match(name)
    assert match is not None
    if match.group(1).rsplit(".", 1)[1] in DOWN:  # [H, I]: zero columns
        if shape[1] != old:
            raise UsageError("model", f"{name}: shape {shape}, expected [*, {old}]")
        return [shape[0], new]
    if shape[0] != old:  # gate/up [I, H]: zero rows
        raise UsageError("model", f"{name}: shape {shape}, expected [{old}, *]")
    return [new, shape[1]]


def _shards(tensors: dict[str, tuple[list[int], torch.dtype]], limit: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in tensors.items():
        nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_shard(path: Path, tensors: dict, read) -> None:
    """A safetensors file of ``tensors`` (name -> (shape, dtype)), each read by
    ``read(name)`` and zero-padded to its shape, written one at a time."""
    names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
    header: dict = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, (shape, dtype) in tensors.items():
        nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        header[name] = {"dtype": names[dtype], "shape": shape, "data_offsets": [at, at + nbytes]}
        at += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, (shape, dtype) in tensors.items():
            source = read(name)
            if list(source.shape) == shape:
                f.write(source.contiguous().view(torch.uint8).numpy())
                continue
            padded = torch.zeros(shape, dtype=dtype)
            padded[: source.shape[0], : source.shape[1]] = source
            f.write(padded.view(torch.uint8).numpy())
