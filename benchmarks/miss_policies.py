"""Miss policies side by side: accuracy against exact, and speed over an emulated link.

    python benchmarks/miss_policies.py [--model DIR] [--calibration DIR] [--budgets 0.5 0.25]
                                       [--paper-budgets 0.75 0.5 0.375] [--windows 12]
                                       [--prompts 16] [--copy-compute-ratio 2.7]

One plugin engine (compiled, started with the calibration) beside one vanilla engine;
modes switch with ``reconfigure``. The link is emulated so that one expert copy takes
``--copy-compute-ratio`` times one MoE layer's batch-1 decode compute (measured on
vanilla, as in ``prefetch.py``), and the host computes experts ``host_slowdown`` (the
config default, 14) times slower than this processor, as a desktop CPU beside a consumer
GPU (both ratios are estimates, see README).

Per mode:

* teacher-forced decode (:mod:`vllm_specexpert.tools.teacher_forcing`): ``--windows`` held-out
  windows, each a 16-token prompt and a 96-token continuation forced one decode step at a
  time at batch 1, so every position runs the mode's real decode path (cache, misses,
  link), after one warm-up window. ``accuracy`` = the model's top-1 is the actual next
  token; ``nll`` = its mean negative log-likelihood; ``agree`` = top-1 equals exact's
  top-1 at the same position (same context); ``tok/s`` = forced tokens / wall time of
  these runs (batch 1); ``MB/token`` = bytes loaded in decode / decode tokens (prefill
  counted apart);
* free-running greedy: ``--prompts`` held-out prompts, 48 tokens each, batched:
  ``greedy`` = share of positions equal to exact's, ``prefix`` = mean share before the
  first divergence.

Table 1: every miss policy at ``--budgets`` (``lowbit``: HOBBIT's INT4 copies). Table 2:
BuddyMoE's settings (its Tables 2-4) at ``--paper-budgets`` (the paper's cache rates c).
Writes ``benchmarks/results/miss_policies.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS,
    add_engine_arguments,
    agreement,
    command_line,
    decode_figures,
    default_calibration,
    greedy_tokens,
    held_out_prompts,
    held_out_windows,
    link_like_a_gpu_box,
    model_of,
    modeled,
    modeled_label,
    prefill_figures,
    teacher_forced,
    write_result,
)

from vllm_specexpert.tools.harness import start_engine, stop_engine

PROMPT_TOKENS, FORCED_TOKENS = 16, 96
UNGATED = {"tau": 0.0, "beta": 1.0}
"""No TAE gate; the batch gate only when every requested expert is missing."""

POLICIES = {
    "fetch (exact)": {"miss_policy": "fetch"},
    "cpu": {"miss_policy": "cpu"},
    "cpu + admission": {"miss_policy": "cpu", "admit_host_experts": True},
    "auto": {"miss_policy": "auto"},
    "auto + admission": {"miss_policy": "auto", "admit_host_experts": True},
    "buddy": {"miss_policy": "buddy"},
    "auto_buddy": {"miss_policy": "auto_buddy"},
    "random": {"miss_policy": "random"},
    "drop": {"miss_policy": "drop"},
    "lowbit": {"miss_policy": "lowbit"},
    "lowbit + admission": {"miss_policy": "lowbit", "admit_host_experts": True},
}
"""Table 1: each policy with its defaults (buddy gates: tau at the 15th TAE percentile,
beta 0.75, rho 1, alpha 0.95, K_max 16; no admission of host-computed experts unless
marked; ``lowbit``'s top_k low-bit slots come out of the budget)."""

PAPER_ROWS = {
    "original (fetch)": {"miss_policy": "fetch"},
    "random": {"miss_policy": "random", "buddy": {**UNGATED, "rho": 4}},
    "buddy a=.75 |B|<=4": {
        "miss_policy": "buddy",
        "buddy": {**UNGATED, "alpha": 0.75, "k_max": 4, "rho": 4},
    },
    "buddy a=.95 |B|<=16": {
        "miss_policy": "buddy",
        "buddy": {**UNGATED, "alpha": 0.95, "k_max": 16, "rho": 4},
    },
    "buddy a=.95 |B|<=16 rho=3": {
        "miss_policy": "buddy",
        "buddy": {**UNGATED, "alpha": 0.95, "k_max": 16, "rho": 3},
    },
    "buddy gated (defaults)": {"miss_policy": "buddy"},
}
"""Table 2: BuddyMoE's rows (CFT alpha, |B| = K_max, rho; no rho = all top-k)."""

DEFAULT_BUDDY = {
    "alpha": 0.95,
    "k_max": 16,
    "tau": None,
    "tau_percentile": 15.0,
    "beta": 0.75,
    "rho": 1,
}


def measure(llm, windows, prompts, plugin: bool) -> dict:
    import vllm_specexpert

    teacher_forced(llm, windows[:1], PROMPT_TOKENS)  # warm-up: compiled shapes, new cache
    if plugin:
        vllm_specexpert.reset_stats(llm)
    forced = teacher_forced(llm, windows, PROMPT_TOKENS)
    result = {"forced": forced}
    if plugin:
        result["stats"] = vllm_specexpert.get_stats(llm)[0]
    result["greedy"] = greedy_tokens(llm, prompts, 48)
    return result


def summarize(name: str, budget: float | None, m: dict, exact: dict, windows) -> dict:
    actual = [t for w in windows for t in w[PROMPT_TOKENS:]]
    top1, exact_top1 = m["forced"]["top1"], exact["forced"]["top1"]
    n = len(actual)
    row = {
        "mode": name,
        "budget": budget,
        "accuracy": sum(a == b for a, b in zip(top1, actual, strict=True)) / n,
        "nll": -sum(m["forced"]["logprobs"]) / n,
        "agree": sum(a == b for a, b in zip(top1, exact_top1, strict=True)) / n,
        "tok_s": n / m["forced"]["seconds"],
        **{f"greedy_{k}": v for k, v in agreement(m["greedy"], exact["greedy"]).items()},
    }
    if "stats" in m:
        # The counters cover the teacher-forced runs only (reset before them); per-token
        # figures are the decode counters over the decode tokens, prefill beside them.
        decode = decode_figures(m["stats"])
        row.update(output=m["stats"]["output"], **decode, prefill=prefill_figures(m["stats"]))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(parser, "miss_policies")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument(
        "--paper-budgets",
        type=float,
        nargs="*",
        default=[0.75, 0.5, 0.375],
        help="budgets of table 2 (none: skip it)",
    )
    parser.add_argument(
        "--modes", nargs="+", help="run only these table-1 modes (the first must be the exact one)"
    )
    parser.add_argument("--windows", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=16)
    args = parser.parse_args()

    import vllm_specexpert
    from vllm_specexpert.tools.teacher_forcing import TeacherForcing

    model = model_of(args)
    calibration = args.calibration or default_calibration(model)
    windows = held_out_windows(args.windows, PROMPT_TOKENS + FORCED_TOKENS)
    prompts = held_out_prompts(args.prompts)
    vanilla = start_engine(model, None, eager=args.eager, logits_processors=[TeacherForcing])
    # Started with lowbit: its INT4 copies are made at load only then (unused by the
    # other modes).
    plugin = start_engine(
        model,
        # (quality null: each mode alone; what the budget an approximate start gets
        # changes is benchmarks/quality.py's)
        {
            "budget": args.budgets[0],
            "calibration": calibration,
            "miss_policy": "lowbit",
            "quality": None,
        },
        eager=args.eager,
        logits_processors=[TeacherForcing],
    )
    link, vanilla_step, expert_bytes = link_like_a_gpu_box(vanilla, plugin, args)

    vanilla_m = measure(vanilla, windows, prompts, plugin=False)
    tables: dict[str, list[dict]] = {"policies": [], "paper": []}
    policies = {n: m for n, m in POLICIES.items() if not args.modes or n in args.modes}
    for table, budgets, modes in (
        ("policies", args.budgets, policies),
        ("paper", args.paper_budgets, PAPER_ROWS),
    ):
        for budget in budgets:
            results = {}
            for name, mode in modes.items():
                # Every mode from the same base: buddy settings reset to the defaults
                # (given only where they apply), no host admission.
                substitutes = mode["miss_policy"] in ("buddy", "auto_buddy", "random")
                buddy = {**DEFAULT_BUDDY, **mode.get("buddy", {})} if substitutes else {}
                vllm_specexpert.reconfigure(
                    plugin,
                    budget=budget,
                    link=link,
                    predictor="none",
                    **{"admit_host_experts": False, **mode, "buddy": buddy},
                )
                results[name] = measure(plugin, windows, prompts, plugin=True)
            exact = next(iter(results.values()))
            assert exact["forced"]["top1"] == vanilla_m["forced"]["top1"], "fetch must be exact"
            rows = (
                [summarize("vanilla", None, vanilla_m, exact, windows)]
                if table == "policies"
                else []
            )
            rows += [summarize(name, budget, m, exact, windows) for name, m in results.items()]
            for row in rows:
                print_row(table, budget, row)
            tables[table] += rows
    stop_engine(plugin)
    stop_engine(vanilla)

    payload = {
        "model": model,
        "calibration": calibration,
        "eager": args.eager,
        "windows": args.windows,
        "prompt_tokens": PROMPT_TOKENS,
        "forced_tokens": FORCED_TOKENS,
        "greedy_prompts": args.prompts,
        "greedy_tokens": 48,
        "modeled": modeled(
            link,
            args.copy_compute_ratio,
            expert_bytes=expert_bytes,
            vanilla_batch1_step_ms=vanilla_step * 1e3,
        ),
        **tables,
    }
    path = write_result(args.name, payload)
    plot(
        tables["policies"],
        RESULTS / f"{args.name}.png",
        f"{Path(model).name}; {'eager' if args.eager else 'compiled'}; tok/s and MB/token are\n"
        f"{modeled_label(link, args.copy_compute_ratio)}\n{command_line()}",
    )
    for table in ("policies", "paper"):
        print_markdown(tables[table])
    print(f"wrote {path} and {path.with_suffix('.png')}\ncommand: {command_line()}")


def print_row(table: str, budget: float, row: dict) -> None:
    print(
        f"[{table} {budget}] {row['mode']}: acc {row['accuracy']:.4f} agree {row['agree']:.4f} "
        f"greedy {row['greedy_agreement']:.3f} tok/s {row['tok_s']:.1f} "
        f"MB/tok {row.get('mb_per_token', 0):.3f}",
        flush=True,
    )


def print_markdown(rows: list[dict]) -> None:
    print(
        "\n| budget | mode | next-token acc. | NLL | top-1 = exact | greedy agreement | prefix "
        "| tok/s | MB/token | per token: fetched / host / substituted / dropped |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        e = r.get("entries_per_token")
        entries = (
            (f"{e['fetched']:.2f} / {e['host']:.2f} / {e['substituted']:.2f} / {e['dropped']:.2f}")
            if e
            else ""
        )
        mode = r["mode"].replace("|", "\\|")  # |B| in BuddyMoE's row names
        print(
            f"| {r['budget'] if r['budget'] is not None else ''} | {mode} "
            f"| {r['accuracy']:.4f} | {r['nll']:.3f} | {r['agree']:.3f} "
            f"| {r['greedy_agreement']:.3f} | {r['greedy_prefix']:.3f} | {r['tok_s']:.1f} "
            f"| {r.get('mb_per_token', 0):.3f} | {entries} |"
        )


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None}, reverse=True)
    markers = dict(zip(budgets, "os^v", strict=False))  # up to four budgets
    vanilla = next(r for r in rows if r["budget"] is None)  # one per budget, same run
    ax.axvline(vanilla["tok_s"], color="grey", ls=":", label="vanilla (all resident)")
    for r in rows:
        if r["budget"] is None:
            continue
        ax.scatter(r["tok_s"], r["agree"], marker=markers[r["budget"]], s=40)
        ax.annotate(
            f"{r['mode'].split(' ')[0]} {r['budget']}",
            (r["tok_s"], r["agree"]),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
    ax.set_xlabel("tokens/s, batch-1 decode, MODELED (emulated link and host; higher is better)")
    ax.set_ylabel("teacher-forced top-1 agreement with exact")
    ax.set_xscale("log")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
