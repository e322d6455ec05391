"""What speculative execution costs in accuracy, per predictor (speculating-experts §4).

    python benchmarks/accuracy.py [--model DIR] [--calibration DIR] [--estimator DIR]
                                  [--analysis DIR] [--budget 0.5 0.25] [--prompts 16]
                                  [--max-tokens 64] [--windows 12]

One plugin engine; each mode runs the same held-out text (validation files of the
corpus, never trained on):

* greedy agreement: ``--prompts`` prompts of 32 held-out tokens, ``--max-tokens``
  greedy tokens each; ``agreement`` is the share of generated positions whose token
  equals the exact mode's, ``prefix`` the mean share before the first divergence;
* next-token accuracy along the decode path: ``--windows`` windows of 16 prompt tokens
  and 96 tokens forced one decode step at a time (prediction and speculation apply to
  decode tokens only, so the text must be decoded, not scored in one prefill pass).
  ``accuracy`` = top-1 prediction is the actual next token; ``nll`` = mean negative
  log-likelihood of the actual token; ``recall`` = the engine's online recall@k over
  these decode tokens.

The speculating modes are speculating-experts Table 1's rows: Router-PF (``router``),
quasi-hidden PF, Est-PF (``estimator``) and Hybrid-PF (``hybrid``), at each budget;
``kept`` is a mode's next-token accuracy over exact's. The estimator modes need an
estimator and analysis (the shipped ones for the embedded model); without them they are
left out, and the run says so.

The exact mode is ``fetch`` without prediction (bit-identical to vanilla vLLM, at any
budget). No link is emulated: nothing here is modeled. Writes
``benchmarks/results/accuracy.json``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    add_predictor_arguments,
    agreement,
    command_line,
    decode_figures,
    default_calibration,
    estimator_artifacts,
    greedy_tokens,
    held_out_prompts,
    held_out_windows,
    model_of,
    teacher_forced,
    write_result,
)

from vllm_specexpert.tools.harness import start_engine, stop_engine

EXACT = {"predictor": "none", "miss_policy": "fetch"}
SPECULATING = ("router", "quasi_hidden", "estimator", "hybrid")
PROMPT_TOKENS, FORCED_TOKENS = 16, 96


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_predictor_arguments(parser)
    parser.add_argument("--budget", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--windows", type=int, default=12)
    parser.add_argument("--name", default="accuracy")
    args = parser.parse_args()

    import vllm_specexpert
    from vllm_specexpert.tools.teacher_forcing import TeacherForcing

    model = model_of(args)
    calibration = args.calibration or default_calibration(model)
    artifacts = estimator_artifacts(model, args)
    predictors = [p for p in SPECULATING if artifacts or p in ("router", "quasi_hidden")]
    llm = start_engine(
        model,
        {
            "budget": args.budget[0],
            "predictor": "quasi_hidden",
            "calibration": calibration,
            **artifacts,
        },
        eager=True,
        max_model_len=512,
        logits_processors=[TeacherForcing],
    )
    prompts = held_out_prompts(args.prompts)
    windows = held_out_windows(args.windows, PROMPT_TOKENS + FORCED_TOKENS)
    actual = [t for w in windows for t in w[PROMPT_TOKENS:]]
    modes = [("exact (fetch)", {"budget": args.budget[0], **EXACT})] + [
        (f"speculate {p} @{b:g}", {"budget": b, "predictor": p, "miss_policy": "speculate"})
        for b in args.budget
        for p in predictors
    ]
    rows, exact = [], None
    for name, mode in modes:
        vllm_specexpert.reconfigure(llm, **mode)
        tokens = greedy_tokens(llm, prompts, args.max_tokens)
        vllm_specexpert.reset_stats(llm)
        forced = teacher_forced(llm, windows, PROMPT_TOKENS)
        exact = exact or {"tokens": tokens, "top1": forced["top1"]}
        stats = vllm_specexpert.get_stats(llm)[0]
        figures = decode_figures(stats)
        top1, n = forced["top1"], len(actual)
        nll = -sum(forced["logprobs"]) / n
        row = {
            "mode": name,
            "budget": mode["budget"],
            **agreement(tokens, exact["tokens"]),
            "accuracy": sum(a == b for a, b in zip(top1, actual, strict=True)) / n,
            "agree": sum(a == b for a, b in zip(top1, exact["top1"], strict=True)) / n,
            "nll": nll,
            "perplexity": math.exp(nll),
            "positions": n,
            "recall": figures["recall"],
            "recall_per_layer": [
                layer["decode"].get("recall") for layer in stats["layers"].values()
            ],
            "decode": figures,
        }
        rows.append(row)
        print(
            f"{name}: acc {row['accuracy']:.4f} nll {nll:.3f} agreement {row['agreement']:.3f}",
            flush=True,
        )
    stop_engine(llm)
    base = rows[0]
    for row in rows:
        row["accuracy_delta"] = row["accuracy"] - base["accuracy"]
        row["kept"] = row["accuracy"] / base["accuracy"]
        row["nll_delta"] = row["nll"] - base["nll"]
    path = write_result(
        args.name,
        {
            "model": model,
            "calibration": calibration,
            **artifacts,
            "budgets": args.budget,
            "prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "windows": len(windows),
            "prompt_tokens": PROMPT_TOKENS,
            "forced_tokens": FORCED_TOKENS,
            "modeled": None,
            "rows": rows,
        },
    )
    print(
        f"\n{'mode':<30}{'agreement':>10}{'prefix':>8}{'next-tok acc':>13}{'kept':>7}"
        f"{'NLL':>7}{'ΔNLL':>7}{'top1=exact':>11}{'recall':>8}"
    )
    for r in rows:
        recall = f"{r['recall']:.3f}" if r["recall"] is not None else "-"
        print(
            f"{r['mode']:<30}{r['agreement']:>10.3f}{r['prefix']:>8.3f}{r['accuracy']:>13.4f}"
            f"{r['kept']:>7.3f}{r['nll']:>7.3f}{r['nll_delta']:>+7.3f}"
            f"{r['agree']:>11.3f}{recall:>8}"
        )
    print(f"wrote {path}\ncommand: {command_line()}")


if __name__ == "__main__":
    main()
