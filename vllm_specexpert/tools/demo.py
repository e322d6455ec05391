"""Offloaded generation on the embedded model, compared with vanilla vLLM.

    specexpert demo [--budget 0.25] [--miss-policy cpu] [--predictor none] [--no-compare] ...

An exact mode (``fetch``) must reproduce vanilla's greedy tokens (the demo fails if not);
an equivalent one (``cpu``, ``auto``) reports how many tokens agree.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from vllm_specexpert.cli import set_cpu_defaults

DEMO_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "# Read a file and count its lines\n",
]


def _generate(model: str, args: argparse.Namespace, specexpert: dict | None):
    from vllm import SamplingParams

    from vllm_specexpert.tools.harness import start_engine, stop_engine

    llm = start_engine(model, specexpert, eager=not args.compile)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(DEMO_PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    stats = None
    if specexpert:
        from vllm_specexpert import reset_stats

        reset_stats(llm)
    start = time.perf_counter()
    outputs = llm.generate(DEMO_PROMPTS, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if specexpert:
        from vllm_specexpert import get_stats

        stats = get_stats(llm)[0]
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    texts = [o.outputs[0].text for o in outputs]
    stop_engine(llm)
    return texts, tokens, sum(map(len, tokens)) / elapsed, stats


def _print_stats(stats: dict) -> None:
    """Per layer, the decode counters (prefill in one line below them)."""
    print(f"\ndecode ({stats['decode_tokens']} tokens)\n{'layer':<34}{'slots':>6}{'hit rate':>10}"
          f"{'recall':>8}{'loads':>7}{'prefetched':>11}{'used':>6}{'host':>6}{'MB moved':>10}"
          f"{'stall ms':>10}")
    rows = [(name, stats["slots_per_layer"][name], layer["decode"])
            for name, layer in stats["layers"].items()]
    for name, slots, layer in rows + [("total", "", stats["total"]["decode"])]:
        recall = f"{layer['recall']:.2f}" if layer["predicted"] else "-"
        print(f"{name:<34}{slots:>6}{layer['hit_rate']:>10.2%}{recall:>8}{layer['loads']:>7}"
              f"{layer['prefetched']:>11}{layer['prefetch_used']:>6}{layer['host_entries']:>6}"
              f"{layer['bytes_loaded'] / 1e6:>10.2f}{layer['stall_s'] * 1e3:>10.1f}")
    prefill = stats["total"]["prefill"]
    print(f"prefill ({stats['prefill_tokens']} tokens): {prefill['loads']} loads, "
          f"{prefill['bytes_loaded'] / 1e6:.2f} MB, {prefill['stall_s'] * 1e3:.1f} ms stalled")


def run(args: argparse.Namespace) -> None:
    set_cpu_defaults()
    from vllm_specexpert.tools.fixtures import DEFAULT_MODEL, TRAINED_CALIBRATION_DIR, model_path

    model = args.model or str(model_path(DEFAULT_MODEL))
    specexpert = {"budget": args.budget, "cache": args.cache, "predictor": args.predictor,
                  "miss_policy": args.miss_policy}
    calibration = args.calibration or (str(TRAINED_CALIBRATION_DIR) if not args.model else None)
    if args.predictor == "quasi_hidden":
        specexpert["calibration"] = calibration
    if args.bandwidth_gbps:
        specexpert["link"] = {"bandwidth_gbps": args.bandwidth_gbps,
                              "latency_us": args.latency_us}
    print(f"model: {model}\nspecexpert: {json.dumps(specexpert)}")
    texts, tokens, tok_s, stats = _generate(model, args, specexpert)
    for prompt, text in zip(DEMO_PROMPTS, texts):
        print(f"\n--- {prompt!r}\n{text}")
    _print_stats(stats)
    print(f"\noffloaded: {tok_s:.1f} tok/s (batch {len(DEMO_PROMPTS)}, "
          f"{stats['slots_per_layer'][next(iter(stats['layers']))]} of "
          f"{next(iter(stats['experts_per_layer'].values()))} experts resident per layer)")
    if args.compare:
        _, vanilla_tokens, vanilla_tok_s, _ = _generate(model, args, None)
        same = sum(a == b for v, o in zip(vanilla_tokens, tokens) for a, b in zip(v, o))
        total = sum(map(len, vanilla_tokens))
        print(f"vanilla vLLM: {vanilla_tok_s:.1f} tok/s; greedy tokens identical: "
              f"{same}/{total} (mode output: {stats['output']})")
        if stats["output"] == "exact" and vanilla_tokens != tokens:
            sys.exit(1)  # an exact mode that is not: a bug


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: the embedded model)")
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--cache", default="lru")
    # Defaults: the fastest exact or equivalent mode measured at the demo's setting
    # (batch 4, budget 0.25, eager, this CPU; benchmarks/results/tpot_eager.json): `cpu`
    # without prefetch. `fetch` is the exact one; prefetch was slower in every setting.
    parser.add_argument("--miss-policy", default="cpu", choices=["fetch", "cpu", "auto"],
                        help="an exact (fetch) or equivalent (cpu, auto) miss policy")
    parser.add_argument("--predictor", default="none",
                        choices=["none", "router", "quasi_hidden"],
                        help="next-layer prediction for prefetch")
    parser.add_argument("--calibration",
                        help="calibration directory (default: the embedded model's)")
    parser.add_argument("--bandwidth-gbps", type=float, default=None,
                        help="emulate a link of this many GB/s (CPU)")
    parser.add_argument("--latency-us", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--compile", action="store_true",
                        help="use vLLM's default torch.compile mode (slower start)")
    parser.add_argument("--no-compare", dest="compare", action="store_false",
                        help="skip the vanilla vLLM run")

