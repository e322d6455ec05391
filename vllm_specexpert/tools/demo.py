"""Offloaded generation on the embedded model, compared token for token with vanilla vLLM.

    specexpert demo [--budget 0.25] [--miss-policy fetch] [--predictor none] [--verbose] ...

Greedy decoding with a repetition penalty (deterministic; a small model's plain greedy
output loops on one line). An exact mode (``fetch``) must reproduce vanilla's tokens (the
demo exits 1 if not); an equivalent one (``cpu``, ``auto``) reports how many agree.
vLLM's own log lines go to a file unless ``--verbose``; the demo prints the plugin's
summary, the samples, the counters and the comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

from vllm_specexpert.vllm_hooks import set_cpu_defaults

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Stack:\n    def __init__(self):",
    "    for i in range(len(items)):",
]
"""The demo's prompts, also the model card's samples (``train-tiny``). A prompt does not
end in a newline before an indented line: the tokenizer merges a newline with the next
line's indentation, so a bare newline token is, in training text, followed by an
unindented line or the end of a file, and the model answers it with end-of-text."""
REPETITION_PENALTY = 1.3
"""Penalty of the demo's and the card's greedy samples."""


@contextlib.contextmanager
def quiet(log_path: str | None):
    """Send this process's and the engine processes' stdout/stderr (vLLM's logs, progress
    bars, warnings) to ``log_path`` while active; ``None``: leave them on the terminal."""
    if log_path is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _generate(model: str, args: argparse.Namespace, specexpert: dict | None):
    with quiet(args.log):  # importing vLLM logs its platform checks
        from vllm import SamplingParams

        from vllm_specexpert.tools.harness import start_engine, stop_engine

        llm = start_engine(model, specexpert, eager=not args.compile)
        params = SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, repetition_penalty=REPETITION_PENALTY
        )
        llm.generate(
            PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False
        )  # warm-up
        if specexpert:
            from vllm_specexpert import reset_stats

            reset_stats(llm)
        start = time.perf_counter()
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        stats = None
        if specexpert:
            from vllm_specexpert import get_stats

            stats = get_stats(llm)[0]
        stop_engine(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    texts = [o.outputs[0].text for o in outputs]
    return texts, tokens, sum(map(len, tokens)) / elapsed, stats


def _print_stats(stats: dict) -> None:
    """Per layer, the decode counters (prefill in one line below them)."""
    print(
        f"\ndecode ({stats['decode_tokens']} tokens)\n{'layer':<34}{'slots':>6}{'hit rate':>10}"
        f"{'recall':>8}{'loads':>7}{'prefetched':>11}{'used':>6}{'host':>6}{'MB moved':>10}"
        f"{'stall ms':>10}"
    )
    rows = [
        (name, stats["slots_per_layer"][name], layer["decode"])
        for name, layer in stats["layers"].items()
    ]
    for name, slots, layer in [*rows, ("total", "", stats["total"]["decode"])]:
        recall = f"{layer['recall']:.2f}" if layer.get("predicted") else "-"
        print(
            f"{name:<34}{slots:>6}{layer['hit_rate']:>10.2%}{recall:>8}{layer['loads']:>7}"
            f"{layer['prefetched']:>11}{layer['prefetch_used']:>6}{layer.get('host_entries', 0):>6}"
            f"{layer['bytes_loaded'] / 1e6:>10.2f}{layer['stall_s'] * 1e3:>10.1f}"
        )
    prefill = stats["total"]["prefill"]
    print(
        f"prefill ({stats['prefill_tokens']} tokens): {prefill['loads']} loads, "
        f"{prefill['bytes_loaded'] / 1e6:.2f} MB, {prefill['stall_s'] * 1e3:.1f} ms stalled"
    )


def run(args: argparse.Namespace) -> None:
    set_cpu_defaults()
    if not args.verbose:
        args.log = os.path.join(tempfile.gettempdir(), "specexpert-demo.log")
        open(args.log, "w").close()
    from vllm_specexpert.tools.embedded_model import TRAINED_CALIBRATION_DIR, TRAINED_MODEL_DIR

    model = args.model or str(TRAINED_MODEL_DIR)
    specexpert = {
        "budget": args.budget,
        "cache": args.cache,
        "predictor": args.predictor,
        "miss_policy": args.miss_policy,
    }
    calibration = args.calibration or (str(TRAINED_CALIBRATION_DIR) if not args.model else None)
    if args.predictor == "quasi_hidden":
        specexpert["calibration"] = calibration
    if args.bandwidth_gbps:
        specexpert["link"] = {"bandwidth_gbps": args.bandwidth_gbps, "latency_us": args.latency_us}
    from vllm_specexpert.config import SpecExpertConfig

    SpecExpertConfig.from_dict(specexpert)  # the settings' own errors, before any engine
    print(
        f"model: {model}\nspecexpert: {json.dumps(specexpert)}"
        + (f"\n(vLLM's logs: {args.log}; --verbose shows them)" if args.log else ""),
        flush=True,
    )
    try:
        texts, tokens, tok_s, stats = _generate(model, args, specexpert)
    except Exception:
        if args.log:
            print(f"the engine failed; the end of {args.log}:", file=sys.stderr)
            with open(args.log) as log:
                print(log.read()[-4000:], file=sys.stderr)
        raise
    print(f"specexpert: {stats['summary']}")
    for prompt, text in zip(PROMPTS, texts, strict=True):
        print(f"\n--- {prompt!r}\n{prompt}{text}")
    _print_stats(stats)
    print(f"\noffloaded: {tok_s:.1f} tok/s (batch {len(PROMPTS)})")
    if args.compare:
        _, vanilla_tokens, vanilla_tok_s, _ = _generate(model, args, None)
        same = sum(
            a == b
            for v, o in zip(vanilla_tokens, tokens, strict=True)
            for a, b in zip(v, o, strict=False)  # one may stop early (EOS)
        )
        total = sum(map(len, vanilla_tokens))
        identical = vanilla_tokens == tokens
        print(
            f"vanilla vLLM: {vanilla_tok_s:.1f} tok/s; greedy tokens identical: {same}/{total}"
            f"{' (the whole output)' if identical else ''}; mode output: {stats['output']}"
        )
        if stats["output"] == "exact" and not identical:
            sys.exit(1)  # an exact mode that is not: a bug


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vllm_specexpert.tools.arguments import (
        existing_dir,
        model_dir,
        non_negative_float,
        positive_float,
        positive_int,
    )

    parser.add_argument(
        "--model", type=model_dir, help="model directory (default: the embedded model)"
    )
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--cache", default="lrfu")
    parser.add_argument(
        "--miss-policy",
        default="fetch",
        choices=["fetch", "cpu", "auto"],
        help="an exact (fetch) or equivalent (cpu, auto) miss policy",
    )
    parser.add_argument(
        "--predictor",
        default="none",
        choices=["none", "router", "quasi_hidden"],
        help="next-layer prediction for prefetch",
    )
    parser.add_argument(
        "--calibration",
        type=existing_dir,
        help="calibration directory (default: the embedded model's)",
    )
    parser.add_argument(
        "--bandwidth-gbps",
        type=positive_float,
        default=None,
        help="emulate a link of this many GB/s (CPU)",
    )
    parser.add_argument("--latency-us", type=non_negative_float, default=10.0)
    parser.add_argument("--max-tokens", type=positive_int, default=64)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="use vLLM's default torch.compile mode (slower start)",
    )
    parser.add_argument(
        "--no-compare", dest="compare", action="store_false", help="skip the vanilla vLLM run"
    )
    parser.add_argument("--verbose", action="store_true", help="show vLLM's logs")
    parser.set_defaults(log=None)
