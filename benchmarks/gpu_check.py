"""The GPU check (`make gpu-check`): what a CUDA machine must confirm before the plugin's
CUDA path is trusted. NOT YET RUN: this project has had no GPU.

    python benchmarks/gpu_check.py [--model DIR] [--budgets 1.0 0.5 0.25] [--max-tokens 64]

Needs vLLM's CUDA build (``pip install -e '.[cuda,test,bench]'``) and a CUDA device;
anywhere else it says so and exits 2. Two engines side by side in one process (vanilla
and the plugin, which switches mode with ``reconfigure``), vLLM's compiled mode:

1. **Exactness**: greedy tokens of the plugin against vanilla's, 16 held-out prompts x
   ``--max-tokens``, at every budget, for ``fetch`` (must be identical, or the mode must
   be reported as equivalent on CUDA) and ``cpu`` (equivalent: agreement reported).
2. **TPOT**: decode seconds per step at batch 1 and 4 for vanilla, the plugin's
   ``fetch``, ``fetch`` + ``quasi_hidden`` prefetch, ``cpu`` and ``auto`` at the budgets
   below 1, and vLLM's own weight offloaders on the same model, offloading the routed
   experts: ``offload_backend="uva"`` (the experts read over PCIe in place, up to the
   same budget's bytes) and ``offload_backend="prefetch"`` (each layer's experts copied
   in one layer ahead).

3. **Quantized checkpoints**: the model's experts quantized by ``specexpert quantize``
   (AWQ, GPTQ, W4A16, FP8), at budget 0.5 under ``fetch``: the plugin (dequantize into
   bf16 slots, the Triton kernel) against vanilla vLLM on its bf16 twin (``specexpert
   dequantize``: must be identical, as on CPU) and against vanilla vLLM on the quantized
   checkpoint itself, with vLLM's own quantized MoE kernel (agreement reported: that
   kernel dequantizes inside its GEMM, in its own order).

Whether the engine ran with CUDA graphs (the plugin currently forces eager mode on
CUDA) is recorded. Writes ``benchmarks/results/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def cuda_problem() -> str | None:
    """Why this machine cannot run the check, or ``None``."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return f"vLLM's platform is {current_platform.device_name}, not CUDA (CPU build?)"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the embedded model)")
    parser.add_argument("--calibration", help="calibration directory")
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default="gpu_check")
    args = parser.parse_args()
    problem = cuda_problem()
    if problem is not None:
        print(f"gpu-check needs a CUDA machine with vLLM's CUDA build: {problem}", file=sys.stderr)
        sys.exit(2)

    from common import (
        agreement,
        command_line,
        default_calibration,
        greedy_tokens,
        held_out_prompts,
        model_of,
        step_seconds,
        write_result,
    )

    import vllm_specexpert
    from vllm_specexpert.tools.harness import start_engine, stop_engine

    model = model_of(args)
    calibration = args.calibration or default_calibration(model)
    prompts = held_out_prompts(16)
    vanilla = start_engine(model, None, eager=False)
    plugin = start_engine(model, {"budget": 1.0, "calibration": calibration}, eager=False)
    info = vllm_specexpert.get_stats(plugin)[0]
    compilation = plugin.llm_engine.vllm_config.compilation_config
    cuda_graphs = {
        "cudagraph_mode": compilation.cudagraph_mode.name,
        "splitting_ops": list(compilation.splitting_ops or []),
    }

    reference = greedy_tokens(vanilla, prompts, args.max_tokens)
    exactness = []
    for budget in args.budgets:
        for policy in ("fetch", "cpu"):
            vllm_specexpert.reconfigure(plugin, budget=budget, miss_policy=policy, predictor="none")
            tokens = greedy_tokens(plugin, prompts, args.max_tokens)
            row = {
                "budget": budget,
                "miss_policy": policy,
                "identical": tokens == reference,
                **agreement(tokens, reference),
            }
            exactness.append(row)
            print(row, flush=True)

    modes = {
        "fetch": {"miss_policy": "fetch", "predictor": "none"},
        "fetch + prefetch": {"miss_policy": "fetch", "predictor": "quasi_hidden"},
        "cpu": {"miss_policy": "cpu", "predictor": "none"},
        "auto": {"miss_policy": "auto", "predictor": "none"},
    }
    tpot = []
    for batch in (1, 4):
        batch_prompts = prompts[:batch]
        step, _ = step_seconds(vanilla, batch_prompts, args.max_tokens, args.repeats)
        tpot.append({"batch": batch, "mode": "vanilla", "tpot_ms": step * 1e3})
        for budget in (b for b in args.budgets if b < 1.0):
            for mode, config in modes.items():
                vllm_specexpert.reconfigure(plugin, budget=budget, **config)
                step, _ = step_seconds(plugin, batch_prompts, args.max_tokens, args.repeats)
                tpot.append({"batch": batch, "mode": f"{mode} {budget}", "tpot_ms": step * 1e3})
                print(tpot[-1], flush=True)
    stop_engine(plugin)
    stop_engine(vanilla)

    expert_gb = info["store_bytes"] / 1e9
    offloaders = {}
    for budget in (b for b in args.budgets if b < 1.0):
        offloaders[f"vllm uva {budget}"] = {
            "offload_backend": "uva",
            "cpu_offload_gb": expert_gb * (1 - budget),
            "cpu_offload_params": {"experts"},
        }
    offloaders["vllm prefetch"] = {
        "offload_backend": "prefetch",
        "offload_group_size": 1,
        "offload_num_in_group": 1,
        "offload_prefetch_step": 1,
        "offload_params": {"experts"},
    }
    for name, engine_args in offloaders.items():
        llm = start_engine(model, None, eager=False, **engine_args)
        for batch in (1, 4):
            step, _ = step_seconds(llm, prompts[:batch], args.max_tokens, args.repeats)
            tpot.append({"batch": batch, "mode": name, "tpot_ms": step * 1e3})
            print(tpot[-1], flush=True)
        stop_engine(llm)

    quantized = quantized_checks(model, prompts, args.max_tokens)
    disk = disk_check(model, prompts, args.max_tokens, reference)

    vanilla_ms = {row["batch"]: row["tpot_ms"] for row in tpot if row["mode"] == "vanilla"}
    for row in tpot:
        row["speed_vs_vanilla"] = vanilla_ms[row["batch"]] / row["tpot_ms"]
    path = write_result(
        args.name,
        {
            "command": command_line(),
            "model": model,
            "cuda_graphs": cuda_graphs,
            "device": __import__("torch").cuda.get_device_name(),
            "exactness": exactness,
            "tpot": tpot,
            "quantized": quantized,
            "disk": disk,
        },
    )
    print(f"wrote {path}\ncommand: {command_line()}")


def disk_check(model: str, prompts: list[str], max_tokens: int, reference: list) -> dict:
    """The disk tier on CUDA: the pack made at start (the checkpoint's layout), pinned
    host rows between it and a quarter of the experts on the device; greedy tokens
    against vanilla's, and what the host rows and the disk served."""
    import tempfile

    from common import agreement, greedy_tokens

    import vllm_specexpert
    from vllm_specexpert.tools.harness import start_engine, stop_engine

    with tempfile.TemporaryDirectory() as work:
        config = {"budget": 0.25, "disk": {"path": f"{work}/pack"}}
        llm = start_engine(model, config, eager=False)
        tokens = greedy_tokens(llm, prompts, max_tokens)
        stats = vllm_specexpert.get_stats(llm)[0]
        stop_engine(llm)
    row = {
        "identical": tokens == reference,
        **agreement(tokens, reference),
        "summary": stats["summary"],
        "disk": stats["disk"],
    }
    print(row, flush=True)
    return row


def quantized_checks(model: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """Step 3 of the module doc: per format, the plugin's greedy tokens against vanilla
    on the bf16 twin and on the quantized checkpoint."""
    import json
    import tempfile

    from common import agreement, greedy_tokens

    from vllm_specexpert.tools import dequantize, quantize
    from vllm_specexpert.tools.harness import start_engine, stop_engine

    config = json.loads((Path(model) / "config.json").read_text())
    hidden = config["hidden_size"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    group = next(g for g in (128, 64, 32) if hidden % g == 0 and inter % g == 0)
    work = Path(tempfile.mkdtemp(prefix="specexpert-gpu-check-"))
    rows = []
    for name in ("awq", "gptq", "w4a16", "fp8"):
        packed, twin = work / name, work / f"{name}-twin"
        quantize.quantize_checkpoint(Path(model), packed, quantize.make_format(name, group), name)
        dequantize.dequantize_checkpoint(packed, twin)
        tokens = {}
        for label, path, specexpert in (
            ("plugin", packed, {"budget": 0.5}),
            ("vanilla twin", twin, None),
            ("vanilla quantized", packed, None),
        ):
            try:
                llm = start_engine(str(path), specexpert, eager=False)
            except (RuntimeError, ValueError) as error:
                # vLLM may have no kernel for a format on this GPU (a config check: ValueError;
                # the engine core's start: RuntimeError, NotImplementedError among them)
                tokens[label] = f"{type(error).__name__}: {error}"[:300]
                continue
            tokens[label] = greedy_tokens(llm, prompts, max_tokens)
            stop_engine(llm)
        row = {"format": name, "group_size": group}
        for other in ("vanilla twin", "vanilla quantized"):
            if isinstance(tokens[other], str) or isinstance(tokens["plugin"], str):
                row[other] = {
                    "error": tokens[other] if isinstance(tokens[other], str) else tokens["plugin"]
                }
            else:
                row[other] = {
                    "identical": tokens["plugin"] == tokens[other],
                    **agreement(tokens["plugin"], tokens[other]),
                }
        rows.append(row)
        print(row, flush=True)
    return rows


if __name__ == "__main__":
    main()
