"""What speculative execution costs in accuracy, per predictor (speculating-experts §4).

    python benchmarks/accuracy.py [--model DIR] [--calibration DIR] [--budget 0.25]
                                  [--prompts 16] [--max-tokens 64] [--windows 24]

One plugin engine; each mode runs the same held-out text (CPython stdlib validation
files, never trained on):

* greedy agreement: ``--prompts`` prompts of 32 held-out tokens, ``--max-tokens``
  greedy tokens each; ``agreement`` is the share of generated positions whose token
  equals the exact mode's, ``prefix`` the mean share before the first divergence;
* next-token accuracy: ``--windows`` windows of 256 held-out tokens, teacher-forced
  (``prompt_logprobs``), every position computed with the mode's routing
  (``max_decode_tokens`` raised so that prediction covers these passes; the prediction
  is per token, so this equals decoding the text token by token with the text forced).
  ``accuracy`` = top-1 prediction is the actual next token; ``nll`` = mean negative
  log-likelihood of the actual token; ``recall`` = the engine's online recall@k.

The exact mode is ``fetch`` without prediction (bit-identical to vanilla vLLM).
Writes ``benchmarks/results/accuracy.json``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, default_calibration, held_out_prompts, write_result  # noqa: E402

from vllm_specexpert.tools.harness import start_engine, stop_engine  # noqa: E402

MODES = {
    "exact (fetch)": {"predictor": "none", "miss_policy": "fetch"},
    "speculate router": {"predictor": "router", "miss_policy": "speculate"},
    "speculate quasi_hidden": {"predictor": "quasi_hidden", "miss_policy": "speculate"},
}
EVERY_PASS = 1 << 30
"""``max_decode_tokens`` that lets prediction cover every forward pass."""


def held_out_windows(count: int, length: int = 256) -> list[list[int]]:
    from vllm_specexpert.tools import corpus
    from vllm_specexpert.tools.fixtures import load_tokenizer

    tokenizer = load_tokenizer()
    windows: list[list[int]] = []
    for f in corpus.corpus_files("validation"):
        ids = tokenizer.encode(f.read()).ids
        windows += [ids[i : i + length] for i in range(0, len(ids) - length + 1, length)]
    step = max(1, len(windows) // count)  # spread over the files
    return windows[::step][:count]


def teacher_forced(llm, windows: list[list[int]]) -> dict:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], params,
                           use_tqdm=False)
    correct = total = 0
    nll = 0.0
    for window, output in zip(windows, outputs):
        for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
            actual = window[position]
            top = min(entry.items(), key=lambda kv: kv[1].rank)[0]
            correct += top == actual
            nll -= entry[actual].logprob
            total += 1
    return {"accuracy": correct / total, "nll": nll / total, "positions": total}


def greedy_tokens(llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def agreement(candidate: list[list[int]], exact: list[list[int]]) -> dict:
    same = [sum(a == b for a, b in zip(c, e)) / len(e) for c, e in zip(candidate, exact)]
    prefix = []
    for c, e in zip(candidate, exact):
        n = next((i for i, (a, b) in enumerate(zip(c, e)) if a != b), len(e))
        prefix.append(n / len(e))
    return {"agreement": sum(same) / len(same), "prefix": sum(prefix) / len(prefix)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the embedded model)")
    parser.add_argument("--calibration", help="calibration directory (default: made on first use)")
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--windows", type=int, default=24)
    parser.add_argument("--name", default="accuracy")
    args = parser.parse_args()

    import vllm_specexpert
    from vllm_specexpert.tools.fixtures import DEFAULT_MODEL, model_path

    model = args.model or str(model_path(DEFAULT_MODEL))
    calibration = args.calibration or default_calibration(model)
    llm = start_engine(model, {"budget": args.budget, "predictor": "quasi_hidden",
                               "calibration": calibration}, eager=True, max_model_len=512)
    prompts = held_out_prompts(args.prompts)
    windows = held_out_windows(args.windows)
    rows, exact_tokens = [], None
    for name, mode in MODES.items():
        vllm_specexpert.reconfigure(llm, max_decode_tokens=64, **mode)
        tokens = greedy_tokens(llm, prompts, args.max_tokens)
        exact_tokens = exact_tokens or tokens
        vllm_specexpert.reconfigure(llm, max_decode_tokens=EVERY_PASS, **mode)
        forced = teacher_forced(llm, windows)
        stats = vllm_specexpert.get_stats(llm)[0]
        layers = list(stats["layers"].values())
        predicted = sum(layer["predicted"] for layer in layers)
        row = {"mode": name, **agreement(tokens, exact_tokens), **forced,
               "perplexity": math.exp(forced["nll"]),
               "recall": (sum(l["predicted_correct"] for l in layers) / predicted) if predicted else None,
               "recall_per_layer": [l["recall"] for l in layers]}
        rows.append(row)
        print(f"{name}: {row}")
    stop_engine(llm)
    base = rows[0]
    for row in rows:
        row["accuracy_delta"] = row["accuracy"] - base["accuracy"]
        row["nll_delta"] = row["nll"] - base["nll"]
    path = write_result(args.name, {
        "model": model, "calibration": calibration, "budget": args.budget,
        "prompts": len(prompts), "max_tokens": args.max_tokens, "windows": len(windows),
        "rows": rows,
    })
    print(f"\n{'mode':<24}{'agreement':>10}{'prefix':>8}{'next-tok acc':>13}{'Δacc':>8}"
          f"{'NLL':>7}{'ΔNLL':>7}{'recall':>8}")
    for r in rows:
        recall = f"{r['recall']:.3f}" if r["recall"] is not None else "-"
        print(f"{r['mode']:<24}{r['agreement']:>10.3f}{r['prefix']:>8.3f}{r['accuracy']:>13.4f}"
              f"{r['accuracy_delta']:>+8.4f}{r['nll']:>7.3f}{r['nll_delta']:>+7.3f}{recall:>8}")
    print(f"wrote {path}\ncommand: {command_line()}")


if __name__ == "__main__":
    main()
