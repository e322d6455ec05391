"""Host (Python) cost of one offloaded MoE layer call at batch 1, and where it goes.

    python benchmarks/host_cost.py [--model DIR] [--max-tokens 64] [--eager] [--name host_cost]

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the model's
forward runs here), so the layer classes can be instrumented in place. Batch-1 greedy
decode; every decode call of the offloaded layer (``OffloadedRoutedExperts.offloaded_forward``,
one token) is timed with ``perf_counter``, and so is the expert
kernel inside it (``SlotKernel``: the CPU kernel vanilla runs, on the slot pool).
*Host cost* = call - kernel: the plugin's bookkeeping, in Python, per layer call.
With ``--eager``, vanilla's ``RoutedExperts.forward_modular`` is timed the same way for
reference (its kernel plus vLLM's own Python around it; compiled, it is traced into the
graph and cannot be timed apart).

Modes: budget 1.0 (every expert resident: pure bookkeeping), 0.5 ``fetch`` (the default
``cache``), the same with ``cache: markov``, 0.5 ``fetch`` + ``quasi_hidden`` prefetch
(no link emulation). Then ``cProfile`` over the budget-1.0
decode calls names the functions the host time goes to; cProfile's own per-call
overhead inflates absolute times, so its shares are reported, and the absolute figures
are the ``perf_counter`` ones. Last, the same engine call in a tight loop outside vLLM
(no-op kernel): what the engine's code costs when it stays in the processor's caches.
Writes ``benchmarks/results/host_cost.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    command_line,
    default_calibration,
    held_out_prompts,
    model_of,
    timed_generate,
    write_result,
)

from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.tools.harness import start_engine, stop_engine

MODES = {
    "budget 1.0": {"budget": 1.0, "miss_policy": "fetch", "predictor": "none"},
    "fetch 0.5": {"budget": 0.5, "miss_policy": "fetch", "predictor": "none"},
    "fetch 0.5, markov": {
        "budget": 0.5,
        "miss_policy": "fetch",
        "predictor": "none",
        "cache": "markov",
    },
    "fetch + prefetch 0.5": {"budget": 0.5, "miss_policy": "fetch", "predictor": "quasi_hidden"},
}


class CallTimer:
    """Wraps a method of a class: per call, its wall time and the tokens it saw; and,
    optionally, the time spent inside a nested method (the kernel)."""

    def __init__(self):
        self.calls: list[tuple[int, float, float]] = []
        """``(tokens, seconds, kernel seconds)`` per call while ``active``."""
        self.active = False
        self.profiler: cProfile.Profile | None = None
        self._kernel_s = 0.0

    def wrap(self, cls, method: str):
        original = getattr(cls, method)
        timer = self

        def timed(layer, x, *args, **kwargs):
            if not timer.active:
                return original(layer, x, *args, **kwargs)
            timer._kernel_s = 0.0
            profiler = timer.profiler if x.shape[0] == 1 else None
            start = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            out = original(layer, x, *args, **kwargs)
            if profiler is not None:
                profiler.disable()
            timer.calls.append((x.shape[0], time.perf_counter() - start, timer._kernel_s))
            return out

        setattr(cls, method, timed)

    def wrap_kernel(self, cls, method: str):
        original = getattr(cls, method)
        timer = self

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = original(*args, **kwargs)
            timer._kernel_s += time.perf_counter() - start
            return out

        setattr(cls, method, timed)

    def decode_summary(self) -> dict:
        decode = [(s, k) for tokens, s, k in self.calls if tokens == 1]
        call = statistics.median(s for s, _ in decode)
        kernel = statistics.median(k for _, k in decode)
        host = statistics.median(s - k for s, k in decode)
        return {
            "decode_calls": len(decode),
            "call_us": call * 1e6,
            "kernel_us": kernel * 1e6,
            "host_us": host * 1e6,
            "host_us_mean": statistics.fmean(s - k for s, k in decode) * 1e6,
        }


def measure(llm, timer: CallTimer, prompt: list[str], max_tokens: int) -> dict:
    timed_generate(llm, prompt, 8)  # warm up (compile, caches)
    timer.calls.clear()
    timer.active = True
    timed_generate(llm, prompt, max_tokens)
    timer.active = False
    return timer.decode_summary()


def profile_shares(profiler: cProfile.Profile, top: int = 25) -> list[dict]:
    stats = pstats.Stats(profiler, stream=io.StringIO())
    total = sum(entry[2] for entry in stats.stats.values())  # tottime
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        {
            "function": f"{Path(file).name}:{line}({name})",
            "calls": entry[1],
            "tottime_share": entry[2] / total,
            "cumtime_share": entry[3] / total,
        }
        for (file, line, name), entry in rows
    ]


def engine_loop_us(num_experts: int = 64, top_k: int = 4, calls: int = 5000) -> float:
    """The same engine call (budget 1.0, batch-1 decode, all hits) in a tight loop
    outside vLLM, with a kernel that does nothing: the engine's own host cost when its
    code and data stay in the processor's caches."""
    import numpy as np
    import torch

    from vllm_specexpert.config import SpecExpertConfig
    from vllm_specexpert.engine import OffloadEngine
    from vllm_specexpert.phases import PassPhases

    engine = OffloadEngine(SpecExpertConfig.from_dict({"budget": 1.0}), torch.device("cpu"))
    tensors = {
        "w13_weight": torch.zeros(num_experts, 8, 4),
        "w2_weight": torch.zeros(num_experts, 4, 4),
    }
    engine.add_layer("layer", tensors, top_k=top_k, index=0)
    engine.start()
    rng = np.random.default_rng(0)
    routings = [
        torch.from_numpy(rng.choice(num_experts, top_k, replace=False).astype(np.int32))[None]
        for _ in range(1000)
    ]
    x, weights = torch.zeros(1, 4), torch.full((1, top_k), 1.0 / top_k)
    phases = PassPhases.decode_only(1)

    def nothing(x, w, ids, slots, expert_map, **_):
        return x

    for ids in routings:
        engine.run_call(LayerCall("layer", nothing, x, weights, ids, phases))
    start = time.perf_counter()
    for i in range(calls):
        engine.run_call(
            LayerCall("layer", nothing, x, weights, routings[i % len(routings)], phases)
        )
    elapsed = time.perf_counter() - start
    engine.close()
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the embedded model)")
    parser.add_argument("--calibration", help="calibration directory")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--eager", action="store_true", help="enforce_eager (default: compiled)")
    parser.add_argument("--name", default="host_cost")
    args = parser.parse_args()

    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts
    from vllm_specexpert.layers.slot_kernel import SlotKernel

    model = model_of(args)
    calibration = args.calibration or default_calibration(model)
    prompt = held_out_prompts(1)

    results = {}
    if args.eager:  # compiled, vanilla's forward_modular is traced into the graph
        vanilla_timer = CallTimer()
        vanilla_timer.wrap(RoutedExperts, "forward_modular")
        vanilla = start_engine(model, None, eager=True)
        results["vanilla forward_modular"] = measure(
            vanilla, vanilla_timer, prompt, args.max_tokens
        )
        stop_engine(vanilla)

    timer = CallTimer()
    timer.wrap(OffloadedRoutedExperts, "offloaded_forward")
    timer.wrap_kernel(SlotKernel, "__call__")
    import vllm_specexpert

    llm = start_engine(model, {**MODES["budget 1.0"], "calibration": calibration}, eager=args.eager)
    for mode, config in MODES.items():
        vllm_specexpert.reconfigure(llm, **config)
        results[mode] = measure(llm, timer, prompt, args.max_tokens)
        print(mode, {k: round(v, 1) for k, v in results[mode].items()}, flush=True)

    vllm_specexpert.reconfigure(llm, **MODES["budget 1.0"])
    timer.profiler = cProfile.Profile()
    measure(llm, timer, prompt, args.max_tokens)
    shares = profile_shares(timer.profiler)
    stop_engine(llm)

    if "vanilla forward_modular" in results:
        print(
            f"vanilla forward_modular per call: "
            f"{results['vanilla forward_modular']['call_us']:.1f} us"
        )
    for row in shares[:15]:
        print(
            f"  {row['tottime_share']:6.1%} self  {row['cumtime_share']:6.1%} cum  "
            f"{row['calls']:>6} calls  {row['function']}"
        )
    loop_us = engine_loop_us()
    print(f"engine call in a tight loop outside vLLM (no-op kernel): {loop_us:.1f} us")
    write_result(
        args.name,
        {
            "command": command_line(),
            "model": model,
            "eager": args.eager,
            "max_tokens": args.max_tokens,
            "batch": 1,
            "per_layer_call": results,
            "engine_loop_us": loop_us,
            "profile_budget_1": {
                "note": "cProfile over budget-1.0 decode calls; shares of "
                "profiled time (kernel included)",
                "top": shares,
            },
        },
    )


if __name__ == "__main__":
    main()
