"""How far the "equivalent" miss policies (``cpu``, ``auto``, ``stream``) drift from
vanilla vLLM.

    python benchmarks/equivalence.py [--models trained qwen3_moe] [--budgets 0.5 0.25]
                                     [--prompts 16] [--max-tokens 64] [--windows 8]
                                     [--policies fetch cpu auto stream]

``cpu`` and ``auto`` run the router's experts with the router's weights, but a token whose
experts are split between the device and the host gets two partial sums, each rounded to
bf16 by vLLM's kernel before they are added; vanilla rounds once. ``stream`` splits a
token whose experts do not fit in one launch into several, each rounded (the greedy
prompts run batched: their decode calls need more experts than the slots hold). The
kernel exposes no fp32 partial output (``cpu_fused_moe`` writes the input dtype), so
the split cannot reproduce vanilla's arithmetic: the modes are "equivalent", not exact.
This measures the drift, on the embedded trained model and on a random-weight fixture
whose logits are nearly flat (the worst case for greedy agreement):

* greedy: ``--prompts`` held-out prompts, ``--max-tokens`` tokens each, batched; share of
  positions equal to vanilla's, mean share before the first divergence, share of
  sequences identical throughout;
* teacher-forced decode (batch 1, ``--windows`` windows of 16 + 64 tokens): top-1 equal to
  vanilla's at the same position, and the largest and mean |Δ logprob| of the forced token.

``fetch`` is included as the control (exact: 1.0 and 0 everywhere). ``cpu`` runs without
an emulated link (the split depends on residency only); ``auto`` needs link and host
times to split at all, so it runs on the MODELED link of ``common.emulated_link``.
Writes ``benchmarks/results/equivalence.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    add_engine_arguments,
    agreement,
    command_line,
    decode_figures,
    greedy_tokens,
    held_out_prompts,
    held_out_windows,
    link_like_a_gpu_box,
    modeled,
    teacher_forced,
    write_result,
)

from vllm_specexpert.tools.harness import start_engine, stop_engine

PROMPT_TOKENS, FORCED_TOKENS = 16, 64


def compare(candidate: dict, vanilla: dict) -> dict:
    forced, ref = candidate["forced"], vanilla["forced"]
    deltas = [abs(a - b) for a, b in zip(forced["logprobs"], ref["logprobs"], strict=True)]
    identical = sum(c == v for c, v in zip(candidate["greedy"], vanilla["greedy"], strict=True))
    top1_agree = sum(a == b for a, b in zip(forced["top1"], ref["top1"], strict=True))
    return {
        **{f"greedy_{k}": v for k, v in agreement(candidate["greedy"], vanilla["greedy"]).items()},
        "greedy_identical_sequences": identical / len(vanilla["greedy"]),
        "forced_top1_agree": top1_agree / len(deltas),
        "forced_max_abs_dlogprob": max(deltas),
        "forced_mean_abs_dlogprob": sum(deltas) / len(deltas),
    }


def run(llm, prompts, windows, max_tokens: int) -> dict:
    return {
        "greedy": greedy_tokens(llm, prompts, max_tokens),
        "forced": teacher_forced(llm, windows, PROMPT_TOKENS),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(parser, "equivalence")
    parser.add_argument(
        "--models",
        nargs="+",
        default=["trained", "qwen3_moe"],
        help="fixture names (the embedded model is 'trained')",
    )
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument(
        "--policies", nargs="+", default=["fetch", "cpu", "auto", "stream"], help="(fetch first)"
    )
    args = parser.parse_args()

    import vllm_specexpert
    from specexpert_testbed.fixtures import ensure_model, model_path
    from vllm_specexpert.tools.teacher_forcing import TeacherForcing

    prompts = held_out_prompts(args.prompts)
    windows = held_out_windows(args.windows, PROMPT_TOKENS + FORCED_TOKENS)
    results, models_modeled = [], {}
    for name in args.models:
        model = str(model_path(name) if name == "trained" else ensure_model(name))
        vanilla = start_engine(model, None, eager=args.eager, logits_processors=[TeacherForcing])
        plugin = start_engine(
            model, {"budget": 1.0}, eager=args.eager, logits_processors=[TeacherForcing]
        )
        link, _, expert_bytes = link_like_a_gpu_box(vanilla, plugin, args)
        models_modeled[name] = modeled(link, args.copy_compute_ratio, expert_bytes=expert_bytes)
        reference = run(vanilla, prompts, windows, args.max_tokens)
        stop_engine(vanilla)
        for budget in args.budgets:
            for policy in args.policies:
                policy_link = link if policy == "auto" else {}
                vllm_specexpert.reconfigure(
                    plugin, budget=budget, miss_policy=policy, link=policy_link
                )
                vllm_specexpert.reset_stats(plugin)
                measured = run(plugin, prompts, windows, args.max_tokens)
                stats = vllm_specexpert.get_stats(plugin)[0]
                row = {
                    "model": name,
                    "budget": budget,
                    "mode": policy,
                    "output": stats["output"],
                    "modeled_link": bool(policy_link),
                    **compare(measured, reference),
                    "host_entries_per_token": decode_figures(stats)["entries_per_token"]["host"],
                }
                results.append(row)
                print(row, flush=True)
        stop_engine(plugin)

    path = write_result(
        args.name,
        {
            "models": args.models,
            "budgets": args.budgets,
            "prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "windows": len(windows),
            "prompt_tokens": PROMPT_TOKENS,
            "forced_tokens": FORCED_TOKENS,
            "modeled": {
                "applies_to": "auto rows (the split follows modeled link and host times)",
                **models_modeled,
            },
            "rows": results,
        },
    )
    print(
        "\n| model | budget | mode | greedy tokens = vanilla | prefix before divergence "
        "| identical sequences | teacher-forced top-1 = vanilla | max / mean abs dlogprob "
        "| host entries / token |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        suffix = " (modeled link)" if r["modeled_link"] else ""
        print(
            f"| {r['model']} | {r['budget']} | {r['mode']}{suffix} "
            f"| {r['greedy_agreement']:.3f} | {r['greedy_prefix']:.3f} "
            f"| {r['greedy_identical_sequences']:.3f} | {r['forced_top1_agree']:.4f} "
            f"| {r['forced_max_abs_dlogprob']:.4f} / {r['forced_mean_abs_dlogprob']:.5f} "
            f"| {r['host_entries_per_token']:.2f} |"
        )
    print(f"wrote {path}\ncommand: {command_line()}")


if __name__ == "__main__":
    main()
