"""What the plugin costs when nothing is offloaded: batch-1 decode TPOT and prefill time
of vanilla vLLM and of the plugin at ``{"budget": 1.0}``, side by side, eager and
compiled.

    python benchmarks/overhead.py [--modes eager compiled] [--rounds 12] [--samples 3]
                                  [--decode-tokens 64] [--prefill-tokens 512]
                                  [--in-process] [--baseline DIR] [--name overhead]

Each engine runs in a fresh Python process of its own, as a new user would start it:
vanilla with ``VLLM_PLUGINS=""`` and without ever importing ``vllm_specexpert`` (no
plugin loaded at all), the plugin with ``additional_config={"specexpert": {"budget":
1.0}}`` and every other setting at its default. Both engines of a mode are up at once
and take turns: a round measures one, then the other, the order alternating from round
to round (ABBA), so that what the machine's other loads do to the timings falls on both.
Per engine and round, ``--samples`` times: a ``--decode-tokens`` generation and a
one-token generation of a 32-token held-out prompt (TPOT = their difference over
``decode-tokens - 1``: prefill and per-request overheads cancel out), and a one-token
generation of a ``--prefill-tokens`` prompt (prefill, reported apart).

Reported per mode and engine: the median over every sample, quartiles, min and max,
each round's median, and the best figure (the fastest run: the machine's other loads
only ever add time; see :func:`best`); the plugin/vanilla ratio of the medians, of the
best figures, and within each round (paired: the two engines measured seconds apart),
with its median and spread. ``--baseline DIR`` adds a third engine: the plugin of
another checkout (``DIR``, e.g. ``git worktree add DIR <commit>``, put first on
``PYTHONPATH``), in the same rounds, so that before and after a change are measured in
one run (the order of the three rotates from round to round); its ratios to vanilla and
the plugin's to it are reported the same way.
vLLM's defaults otherwise (engine core in its own process; ``--in-process`` runs it in
the engine's process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The environment passes
through: on a shared machine note that vLLM's CPU workers bind their OpenMP thread to
the same core by default (``auto``: core 0 on 2 cores, the other one reserved), so
another engine running there slows either engine by up to tens of times for a while;
``VLLM_CPU_OMP_THREADS_BIND=1`` moves both of these to the other core. The JSON keeps
every sample and round. Writes ``benchmarks/results/<name>.json`` and ``<name>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLUGIN_CONFIG = {"budget": 1.0}
MAX_MODEL_LEN = 1024
FIGURES = {"decode": "tpot", "prefill": "prefill"}
"""Result key -> sample key: decode TPOT and prefill time (wall clock)."""
ENVIRONMENT = (
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "OMP_NUM_THREADS",
)


# ------------------------------------------------------------------- engine process
# Runs in the fresh process. Imports vLLM only: the vanilla engine must not import the
# plugin (and nothing here does; the plugin engine loads it through vLLM's entry point).


def serve(request: dict) -> None:
    """One engine; answers the parent's commands (one JSON line each) on the original
    stdout, everything vLLM prints goes to stderr."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams

    extra = (
        {"additional_config": {"specexpert": request["specexpert"]}}
        if request["specexpert"] is not None
        else {}
    )
    llm = LLM(
        model=request["model"],
        dtype="bfloat16",
        enforce_eager=request["eager"],
        max_model_len=MAX_MODEL_LEN,
        seed=0,
        **extra,
    )

    def generate(ids: list[int], tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return time.perf_counter() - start

    generate(request["decode"], 8)
    generate(request["prefill"], 1)
    plugin = sys.modules.get("vllm_specexpert")
    info = {
        "plugin_imported_here": plugin is not None,
        "plugin_file": getattr(plugin, "__file__", None),
        "VLLM_PLUGINS": os.environ.get("VLLM_PLUGINS"),
    }
    replies.write(json.dumps({"ready": info}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        if command["op"] == "stats":
            import vllm_specexpert  # the plugin engine only

            stats = vllm_specexpert.get_stats(llm)[0]
            replies.write(
                json.dumps(
                    {
                        "stats": {
                            "output": stats["output"],
                            "summary": stats["summary"],
                            "decode_tokens": stats["decode_tokens"],
                            "prefill_tokens": stats["prefill_tokens"],
                            "decode": stats["total"]["decode"],
                            "prefill": stats["total"]["prefill"],
                        }
                    },
                    default=str,
                )
                + "\n"
            )
            continue
        n = command["decode_tokens"]
        generate(request["decode"], 4)  # back in the caches after the other engine's turn
        result = {"tpot": [], "prefill": [], "full": [], "first": []}
        for _ in range(command["samples"]):
            full = generate(request["decode"], n)
            first = generate(request["decode"], 1)
            result["tpot"].append((full - first) / (n - 1))
            result["full"].append(full)
            result["first"].append(first)
            result["prefill"].append(generate(request["prefill"], 1))
        replies.write(json.dumps(result) + "\n")
    llm.llm_engine.engine_core.shutdown()


def breakdown(request: dict) -> None:
    """Where a budget-1.0 decode layer call's time goes (compiled plugin engine, engine
    core in this process): one decode call's inputs and forward context are captured,
    then each level of the call is timed on them in a tight loop, the levels
    interleaved, the fastest of ``rounds`` loops kept (a tight loop keeps code and data
    in the processor's caches: a real pass pays more per level, see the TPOT figures).
    Prints one JSON line."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import torch
    from vllm import LLM, SamplingParams
    from vllm.forward_context import get_forward_context, override_forward_context

    from vllm_specexpert.layer_call import LayerCall
    from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts

    captured: dict = {}
    layer_call = OffloadedRoutedExperts.offloaded_forward

    def capture(layer, x, topk_weights, topk_ids, out):
        if x.shape[0] == 1 and not captured:
            captured.update(
                context=get_forward_context(),
                layer=layer,
                x=x.clone(),
                weights=topk_weights.clone(),
                ids=topk_ids.clone(),
            )
        return layer_call(layer, x, topk_weights, topk_ids, out)

    OffloadedRoutedExperts.offloaded_forward = capture
    llm = LLM(
        model=request["model"],
        dtype="bfloat16",
        enforce_eager=False,
        max_model_len=MAX_MODEL_LEN,
        seed=0,
        additional_config={"specexpert": PLUGIN_CONFIG},
    )
    llm.generate(
        [{"prompt_token_ids": request["decode"]}],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    OffloadedRoutedExperts.offloaded_forward = layer_call
    layer, x, weights, ids = (captured[k] for k in ("layer", "x", "weights", "ids"))
    engine = layer.engine
    slots = engine.layers[layer.layer_name].cache.slots
    w13, w2 = slots["w13_weight"], slots["w2_weight"]
    out = torch.empty_like(x)
    key = layer._context_key
    fused_moe, op = torch.ops._C.cpu_fused_moe.default, torch.ops.specexpert.routed_experts

    def nothing(x, topk_weights, topk_ids, out, layer_key) -> None:
        return None

    # The routed-experts op's schema, registered as direct_register_custom_op does.
    library = torch.library.Library("specexpert_overhead", "FRAGMENT")
    library.define(
        "nothing(Tensor x, Tensor topk_weights, Tensor topk_ids, "
        "Tensor(a!) out, str layer_key) -> ()"
    )
    library.impl("nothing", nothing, "CPU")
    no_op = torch.ops.specexpert_overhead.nothing.default

    def graph_call():  # what the compiled graph runs for the layer
        buffer = torch.empty_like(x)
        op.default(x, weights, ids, buffer, key)

    levels = {
        "vanilla: cpu_fused_moe op on the same weights": lambda: fused_moe(
            out, x, w13, w2, None, None, weights, ids, False, "silu", "vec"
        ),
        "plugin kernel (SlotKernel: allocates its output)": lambda: layer.slot_kernel(
            x, weights, ids, slots
        ),
        "engine.run_call (the engine's path for it)": lambda: engine.run_call(
            LayerCall(layer.layer_name, layer.slot_kernel, x, weights, ids)
        ),
        "the adapter's layer call (into the op's buffer)": lambda: layer.offloaded_forward(
            x, weights, ids, out
        ),
        "the custom op as the compiled graph calls it (buffer + op)": graph_call,
        "a Python custom op that does nothing (dispatch only)": lambda: no_op(
            x, weights, ids, out, key
        ),
    }
    loops, rounds = request["breakdown_loops"], request["breakdown_rounds"]
    fastest = dict.fromkeys(levels, float("inf"))
    with override_forward_context(captured["context"]):
        for _ in range(rounds):
            for name, level in levels.items():
                start = time.perf_counter_ns()
                for _ in range(loops):
                    level()
                fastest[name] = min(fastest[name], (time.perf_counter_ns() - start) / loops)
    replies.write(json.dumps({name: ns / 1e3 for name, ns in fastest.items()}) + "\n")
    llm.llm_engine.engine_core.shutdown()


# ------------------------------------------------------------------------- parent


class Engine:
    """A fresh process running :func:`serve`."""

    def __init__(self, name: str, request: dict, env: dict, log: Path):
        self.name = name
        self.log = log
        with open(log, "w") as stderr:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                [sys.executable, __file__, "--serve", json.dumps(request)],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )

    def reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(f"{self.name} engine exited ({self.log}):\n{tail}")
        return json.loads(line)

    def ask(self, command: dict) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self.reply()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.process.stdin.flush()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()


def engine_env(plugin: bool, in_process: bool) -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if plugin:
        env.pop("VLLM_PLUGINS", None)  # every installed plugin, as a new user has it
    else:
        env["VLLM_PLUGINS"] = ""
    return env


def spread(values: list[float]) -> dict:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {
        "median": statistics.median(values),
        "q1": q[0],
        "q3": q[2],
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def best(rounds: list[dict], engine: str, key: str, decode_tokens: int) -> float:
    """The engine's least disturbed figure (ms): other loads on the machine only ever
    add time, so the fastest of many runs is the closest to the code's own cost. Decode:
    the fastest ``decode_tokens`` generation less the median one-token generation, per
    decode step (a min of the difference would reward a disturbed one-token run)."""

    def every(name):
        return [v for r in rounds for v in r[engine][name]]

    if key == "prefill":
        return min(every("prefill")) * 1e3
    return (min(every("full")) - statistics.median(every("first"))) / (decode_tokens - 1) * 1e3


def summarize(rounds: list[dict], key: str, decode_tokens: int, names: list[str]) -> dict:
    """Per engine: the spread of every sample, each round's median and the best figure
    (ms); the ratio plugin / vanilla of the medians, within each round, and of the best
    figures (with a baseline also ``baseline/vanilla`` and ``plugin/baseline``)."""
    out: dict = {}
    figure = FIGURES[key]
    for engine in names:
        samples = [v * 1e3 for r in rounds for v in r[engine][figure]]
        out[engine] = {
            **spread(samples),
            "best": best(rounds, engine, key, decode_tokens),
            "round_medians": [statistics.median(r[engine][figure]) * 1e3 for r in rounds],
        }
    out.update(ratios(out, "plugin", "vanilla"))
    if "baseline" in names:
        out["baseline/vanilla"] = ratios(out, "baseline", "vanilla")
        out["plugin/baseline"] = ratios(out, "plugin", "baseline")
    return out


def ratios(out: dict, engine: str, to: str) -> dict:
    """``engine``'s figures over ``to``'s: of the medians, of the best, paired by round."""
    paired = [
        a / b for a, b in zip(out[engine]["round_medians"], out[to]["round_medians"], strict=True)
    ]
    return {
        "ratio": out[engine]["median"] / out[to]["median"],
        "best_ratio": out[engine]["best"] / out[to]["best"],
        "paired_ratio": {**spread(paired), "per_round": paired},
    }


def measure_mode(mode: str, model: str, prompts: dict, args, logs: Path) -> dict:
    eager = mode == "eager"
    engines = {}
    kinds = [("vanilla", None, None), ("plugin", PLUGIN_CONFIG, None)]
    if args.baseline:
        kinds.append(("baseline", PLUGIN_CONFIG, args.baseline))
    names = [name for name, _, _ in kinds]
    try:
        for name, config, path in kinds:
            request = {"model": model, "eager": eager, "specexpert": config, **prompts}
            env = engine_env(config is not None, args.in_process)
            if path is not None:  # the other checkout's package first
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
            engines[name] = Engine(
                f"{mode} {name}", request, env, logs / f"{args.name}-{mode}-{name}.log"
            )
        started = time.perf_counter()
        info = {name: engine.reply()["ready"] for name, engine in engines.items()}
        print(f"{mode}: engines up in {time.perf_counter() - started:.0f} s", flush=True)
        assert not info["vanilla"]["plugin_imported_here"]
        if args.baseline:  # (the plugin may load in the engine core's process only)
            loaded = info["baseline"]["plugin_file"]
            assert loaded is None or loaded.startswith(str(Path(args.baseline).resolve())), loaded
        rounds = []
        for index in range(args.rounds):
            # ABBA for two; for three, each takes each place in turn.
            shift = index % len(names)
            order = names[shift:] + names[:shift]
            if len(names) == 2 and index % 2:
                order = names[::-1]
            result = {
                name: engines[name].ask(
                    {"op": "measure", "samples": args.samples, "decode_tokens": args.decode_tokens}
                )
                for name in order
            }
            rounds.append({"first": order[0], **result})
            v, p = (statistics.median(result[n]["tpot"]) * 1e3 for n in ("vanilla", "plugin"))
            vp, pp = (statistics.median(result[n]["prefill"]) * 1e3 for n in ("vanilla", "plugin"))
            print(
                f"{mode} round {index + 1}/{args.rounds}: TPOT vanilla {v:.3f} ms, "
                f"plugin {p:.3f} ms ({p / v - 1:+.1%}); prefill {vp:.1f} / {pp:.1f} ms "
                f"({pp / vp - 1:+.1%})",
                flush=True,
            )
        # The plugin ran every layer call (its counters), the vanilla process never
        # imported it (checked above; its engine processes start with VLLM_PLUGINS="").
        stats = engines["plugin"].ask({"op": "stats"})["stats"]
    finally:
        for engine in engines.values():
            engine.close()
    return {
        "mode": mode,
        "engines": info,
        "plugin_stats": stats,
        "rounds": rounds,
        **{key: summarize(rounds, key, args.decode_tokens, names) for key in FIGURES},
    }


def run_breakdown(model: str, prompts: dict, args, logs: Path) -> dict[str, float]:
    """:func:`breakdown` in a fresh plugin process."""
    request = {
        "model": model,
        "decode": prompts["decode"],
        "breakdown_loops": args.breakdown_loops,
        "breakdown_rounds": args.breakdown_rounds,
    }
    env = engine_env(True, True)
    log = logs / f"{args.name}-breakdown.log"
    with open(log, "w") as stderr:
        done = subprocess.run(
            [sys.executable, __file__, "--breakdown-serve", json.dumps(request)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    if done.returncode != 0:
        raise RuntimeError(f"breakdown failed ({log}):\n{log.read_text()[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(FIGURES), len(results), figsize=(5.5 * len(results), 7), squeeze=False
    )
    labels = {"decode": "TPOT ms", "prefill": "prefill ms"}
    for column, result in enumerate(results):
        for row, key in enumerate(FIGURES):
            ax = axes[row, column]
            summary = result[key]
            for engine, color in (
                ("vanilla", "#555"),
                ("plugin", "#3b7dd8"),
                ("baseline", "#d8903b"),
            ):
                if engine not in summary:
                    continue
                values = summary[engine]["round_medians"]
                ax.plot(
                    range(1, len(values) + 1),
                    values,
                    "o-",
                    color=color,
                    label=f"{engine} (median {summary[engine]['median']:.3f})",
                )
            ax.set_title(
                f"{result['mode']} {key}: plugin/vanilla {summary['ratio']:.3f} "
                f"(paired {summary['paired_ratio']['min']:.3f}-"
                f"{summary['paired_ratio']['max']:.3f})",
                fontsize=8,
            )
            ax.set_xlabel("round")
            ax.set_ylabel(labels[key])
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def baseline_of(path: str | None) -> dict | None:
    """The baseline checkout and its commit (``None``: no baseline)."""
    if path is None:
        return None
    commit = subprocess.run(
        ["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {"path": str(Path(path).resolve()), "commit": commit or None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the embedded model)")
    parser.add_argument(
        "--modes", nargs="*", choices=("eager", "compiled"), default=["eager", "compiled"]
    )
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--samples", type=int, default=3, help="per engine and round")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="engine core in the engine's process (default: vLLM's, its own)",
    )
    parser.add_argument(
        "--breakdown-loops",
        type=int,
        default=1000,
        help="calls per timed loop of the layer-call breakdown (0: skip it)",
    )
    parser.add_argument("--breakdown-rounds", type=int, default=30)
    parser.add_argument(
        "--baseline",
        help="a checkout of the package whose plugin runs beside, in the same rounds "
        "(before/after a change)",
    )
    parser.add_argument("--name", default="overhead", help="result file name")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import RESULTS, command_line, model_of, write_result

    from vllm_specexpert.tools import corpus
    from vllm_specexpert.tools.embedded_model import load_tokenizer

    model = model_of(args)
    tokenizer = load_tokenizer()
    files = sorted(corpus.corpus_files("validation"), key=lambda f: -f.size)
    text = "\n".join(f.read() for f in files[:8])
    ids = tokenizer.encode(text).ids
    if len(ids) < args.prefill_tokens:
        raise SystemExit(f"the held-out text has {len(ids)} tokens < --prefill-tokens")
    prompts = {
        "decode": tokenizer.encode(files[0].read()).ids[:32],
        "prefill": ids[: args.prefill_tokens],
    }
    logs = Path(tempfile.mkdtemp(prefix="specexpert-overhead-"))
    print(f"engine logs in {logs}", flush=True)

    results = [measure_mode(mode, model, prompts, args, logs) for mode in args.modes]
    layer_call = None
    if args.breakdown_loops:
        layer_call = run_breakdown(model, prompts, args, logs)
    payload = {
        "model": model,
        "plugin_config": PLUGIN_CONFIG,
        "rounds": args.rounds,
        "samples_per_round": args.samples,
        "decode_tokens": args.decode_tokens,
        "decode_prompt_tokens": len(prompts["decode"]),
        "prefill_tokens": args.prefill_tokens,
        "engine_core": "in process" if args.in_process else "own process (vLLM default)",
        "environment": {name: os.environ.get(name) for name in ENVIRONMENT},
        "baseline": baseline_of(args.baseline),
        "layer_call_breakdown_us": layer_call,
        "ratios": {
            r["mode"]: {
                figure: {
                    "ratio_of_medians": r[figure]["ratio"],
                    "ratio_of_best": r[figure]["best_ratio"],
                    "paired_median": r[figure]["paired_ratio"]["median"],
                    "paired_min": r[figure]["paired_ratio"]["min"],
                    "paired_max": r[figure]["paired_ratio"]["max"],
                }
                for figure in FIGURES
            }
            for r in results
        },
        "results": results,
    }
    path = write_result(args.name, payload)
    if results:
        plot(
            results,
            RESULTS / f"{args.name}.png",
            f"{Path(model).name}: vanilla (no plugin) vs plugin at budget 1.0, batch 1, "
            f"round medians\n{command_line()}",
        )

    print(
        f"\n{'mode':<10}{'figure':<9}{'vanilla ms':>11}{'plugin ms':>11}{'ratio':>7}"
        f"{'paired median [min, max]':>27}{'vanilla IQR':>18}{'plugin IQR':>18}"
        f"{'best: vanilla':>15}{'plugin':>8}{'ratio':>7}"
    )
    for r in results:
        for key in FIGURES:
            s = r[key]
            v, p, pr = s["vanilla"], s["plugin"], s["paired_ratio"]
            if "baseline" in s:
                for pair in ("baseline/vanilla", "plugin/baseline"):
                    q = s[pair]["paired_ratio"]
                    print(
                        f"{r['mode']:<10}{key:<9}{pair}: baseline {s['baseline']['median']:.3f} "
                        f"ms, ratio of medians {s[pair]['ratio']:.3f}, paired "
                        f"{q['median']:.3f} [{q['min']:.3f}, {q['max']:.3f}], best "
                        f"{s[pair]['best_ratio']:.3f}"
                    )
            print(
                f"{r['mode']:<10}{key:<9}{v['median']:>11.3f}{p['median']:>11.3f}"
                f"{s['ratio']:>7.3f}{pr['median']:>11.3f} [{pr['min']:.3f}, {pr['max']:.3f}]"
                f"{v['q1']:>9.3f}-{v['q3']:<8.3f}{p['q1']:>9.3f}-{p['q3']:<8.3f}"
                f"{v['best']:>15.3f}{p['best']:>8.3f}{s['best_ratio']:>7.3f}"
            )
    if layer_call is not None:
        print(
            "\none budget-1.0 decode layer call, compiled, tight loop (fastest of "
            f"{args.breakdown_rounds} x {args.breakdown_loops} calls):"
        )
        for name, us in layer_call.items():
            print(f"{us:8.2f} us  {name}")
    print(f"wrote {path} and {path.with_suffix('.png')}\ncommand: {command_line()}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        serve(json.loads(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "--breakdown-serve":
        breakdown(json.loads(sys.argv[2]))
    else:
        main()
