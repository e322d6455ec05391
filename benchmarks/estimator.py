"""What the neural estimator costs per layer call, and what the router-free path saves.

    python benchmarks/estimator.py [--model DIR] [--estimator DIR] [--analysis DIR]
                                   [--batches 1 8] [--budget 0.25] [--rounds 3]
                                   [--max-tokens 48] [--copy-compute-ratio 2.7]

1. Per layer call, measured inside the running vLLM worker on its own tensors: one
   prediction by ``quasi_hidden`` and by ``estimator`` (q_l, then the network and the
   model's selection), and one router call (the gate's GEMM and ``select_experts``, what
   ``router_free`` skips), for batches of 1, 8 and 32 decode tokens; medians of 200.
2. Decode TPOT and prefill (time to the first token) under ``speculate`` with
   ``estimator`` and ``hybrid``, each without and with ``router_free``, beside
   ``quasi_hidden``, in interleaved rounds, on an emulated link where one expert copy
   takes ``--copy-compute-ratio`` times one MoE layer's decode compute at budget 1.0
   (MODELED, see ``common.emulated_link``; the host is not used: ``speculate`` fetches).

The engine runs eagerly (``enforce_eager``): ``router_free`` needs it on the CPU build.
Writes ``benchmarks/results/estimator.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    add_predictor_arguments,
    command_line,
    decode_figures,
    default_calibration,
    estimator_artifacts,
    held_out_prompts,
    link_like_a_gpu_box,
    model_of,
    modeled,
    step_seconds,
    write_result,
)

from vllm_specexpert.tools.harness import start_engine, stop_engine

# The engine core and its worker in this process: the per-call timing runs in the
# worker through ``apply_model`` (a function of this script, not importable there).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

CALL_BATCHES = (1, 8, 32)
MODES = {
    "quasi_hidden": {"predictor": "quasi_hidden", "router_free": False},
    "estimator": {"predictor": "estimator", "router_free": False},
    "estimator router_free": {"predictor": "estimator", "router_free": True},
    "hybrid": {"predictor": "hybrid", "router_free": False},
    "hybrid router_free": {"predictor": "hybrid", "router_free": True},
}


def per_call_costs(model) -> dict:
    """Medians in microseconds per layer call of the second MoE layer (run in the
    worker by ``apply_model``): ``quasi_hidden`` and ``estimator`` predictions of the
    third layer's routing, and the third layer's router."""
    import torch

    from vllm_specexpert.layers.model_classes import _offloaded_layers
    from vllm_specexpert.predict import (
        EstimatorPredictor,
        LayerState,
        QuasiHiddenPredictor,
    )

    layers = _offloaded_layers(model)
    (_, _, routed), (_, layer, _) = layers[1], layers[2]
    engine = routed.engine
    inputs = engine.inputs["predictor_inputs"]
    predictors = {
        "quasi_hidden": QuasiHiddenPredictor.build(inputs),
        "estimator": EstimatorPredictor.build(inputs),
    }
    nxt = engine.inputs["next_routing"][routed.layer_name]
    runner = layer.mlp.experts
    hook = getattr(layers[2][2], "router_free_hook", None)
    select = hook.select_experts if hook is not None else runner.router.select_experts
    gate = hook.gate_forward if hook is not None else runner.gate.forward
    hidden = engine.inputs["predictor_inputs"].default_vectors[routed.layer_name].shape[1]
    experts = engine.inputs["predictor_inputs"].default_vectors[routed.layer_name].shape[0]
    top_k = engine.layers[routed.layer_name].top_k

    def median_us(fn, reps: int = 200) -> float:
        for _ in range(10):
            fn()
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e6

    result = {}
    g = torch.Generator().manual_seed(0)
    for tokens in CALL_BATCHES:
        x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
        state = LayerState(x, ids.to(torch.int32), weights)
        with torch.no_grad():
            row = {
                name: median_us(lambda p=p, s=state: p.predict(s, routed.layer_name, nxt))
                for name, p in predictors.items()
            }
            row["router"] = median_us(lambda x=x: select(hidden_states=x, router_logits=gate(x)[0]))
        result[tokens] = row
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_predictor_arguments(parser)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--copy-compute-ratio", type=float, default=2.7)
    parser.add_argument("--latency-us", type=float, default=10.0)
    args = parser.parse_args()

    import vllm_specexpert

    model = model_of(args)
    artifacts = estimator_artifacts(model, args)
    if not artifacts:
        sys.exit("benchmarks/estimator.py needs an estimator and an analysis")
    config = {
        "budget": args.budget,
        "predictor": "estimator",
        "miss_policy": "speculate",
        "calibration": args.calibration or default_calibration(model),
        **artifacts,
    }
    # One engine (the per-call timing needs it in this process, and a second in-process
    # engine cannot be stopped without taking the first's process groups): the link is
    # sized on its own budget-1.0 step, which is vanilla's within noise (tpot.json).
    plugin = start_engine(model, config, eager=True, max_model_len=512)
    vllm_specexpert.reconfigure(plugin, budget=1.0, predictor="none", miss_policy="fetch")
    link, full_step, _ = link_like_a_gpu_box(plugin, plugin, args)
    vllm_specexpert.reconfigure(plugin, **config)
    costs = plugin.apply_model(per_call_costs)[0]
    print("per layer call (us):", costs)
    vllm_specexpert.reconfigure(plugin, link={**link})
    rows = []
    for batch in args.batches:
        prompts = held_out_prompts(batch)
        samples: dict[str, list] = {name: [] for name in MODES}
        for _ in range(args.rounds):
            for name, mode in MODES.items():
                vllm_specexpert.reconfigure(plugin, **mode)
                vllm_specexpert.reset_stats(plugin)
                samples[name].append(step_seconds(plugin, prompts, args.max_tokens, 1))
        stats = {}
        for name, mode in MODES.items():  # counters of one more run per mode
            vllm_specexpert.reconfigure(plugin, **mode)
            vllm_specexpert.reset_stats(plugin)
            step_seconds(plugin, prompts, args.max_tokens, 1)
            stats[name] = vllm_specexpert.get_stats(plugin)[0]
        for name in MODES:
            decode = statistics.median(s[0] for s in samples[name])
            first = statistics.median(s[1] for s in samples[name])
            d = stats[name]["total"]["decode"]
            rows.append(
                {
                    "batch": batch,
                    "mode": name,
                    "tpot_ms": decode * 1e3,
                    "first_token_ms": first * 1e3,
                    "router_free_calls": d["router_free_calls"],
                    "speculated_calls": d["speculated_calls"],
                    "decode": decode_figures(stats[name]),
                }
            )
        base = {r["mode"]: r["tpot_ms"] for r in rows if r["batch"] == batch}
        for r in rows:
            if r["batch"] == batch:
                r["vs_without_router_free"] = (
                    r["tpot_ms"] / base[r["mode"].replace(" router_free", "")]
                )
    stop_engine(plugin)
    path = write_result(
        "estimator",
        {
            "model": model,
            **artifacts,
            "budget": args.budget,
            "rounds": args.rounds,
            "max_tokens": args.max_tokens,
            "budget_1_step_ms": full_step * 1e3,
            "per_call_us": costs,
            "modeled": modeled(link, args.copy_compute_ratio, note="TPOT rows only"),
            "rows": rows,
        },
    )
    print(
        f"\n{'batch':>5} {'mode':<24}{'TPOT ms':>9}{'vs no rf':>9}{'1st tok ms':>11}"
        f"{'rf calls':>9}{'spec calls':>11}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['mode']:<24}{r['tpot_ms']:>9.2f}"
            f"{r['vs_without_router_free']:>9.3f}{r['first_token_ms']:>11.1f}"
            f"{r['router_free_calls']:>9}{r['speculated_calls']:>11}"
        )
    print(f"wrote {path}\ncommand: {command_line()}")


if __name__ == "__main__":
    main()
