"""What each residency reads against Belady's MIN, per batch: the recorded routes of the
embedded model replayed through the plugin's own engine under each ``cache`` policy
(``fetch``, every request every step), and through MIN at the same slots (issue 76).

    python benchmarks/residency_bound.py [--batches 1 8 32 128] [--budgets 0.25 0.5]
                                         [--caches lru lfu lrfu markov]
                                         [--half-lives 2 4 8 16]
                                         [--region-caches lru lrfu markov]
                                         [--horizons 1 4 16]

Routes are recorded once (transformers, greedy, held-out prompts, ``--max-tokens`` per
request: :func:`~vllm_specexpert.tools.trace.record_routes`); under ``fetch`` they do
not depend on the cache, so every policy replays the same calls. Loads are counted by
the engine (tiny random weights: no timing, no link). Two bounds:

- ``min (per layer)``: MIN on each layer's calls at its own slots (the engine keeps a
  fixed count of slots per layer), each distinct expert of a call one request, from the
  engine's warm start: no residency of those slots that loads an expert once a call
  loads fewer (an exact engine whose call outgrows its slots loads more, in token
  groups);
- ``min (pooled)``: the same on one cache of every layer's slots together.

With ``markov`` among the caches, it runs again with its prediction on at every call
(``markov, prediction always on``): what its judge, by bytes against plain frequency,
saves or costs. ``--horizons`` also replays ``markov`` told the true routes of so many
coming steps: the share of the gap to MIN a predictor of that reach could close (each
row's share of LRU's gap to MIN closed is in its last column). ``--half-lives`` also
replays ``lrfu`` at each half-life (the constant
``LRFU_HALF_LIFE``, in launches of a layer), to choose it. Writes
``benchmarks/results/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, held_out_prompts, write_result

from specexpert_testbed.fixtures import DEFAULT_MODEL, model_path
from vllm_specexpert.planner import bytes_judge
from vllm_specexpert.tiers import eviction
from vllm_specexpert.tools.trace import record_routes


def _benchmark(name: str):
    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).resolve().parent / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cache_bound = _benchmark("cache_bound")
clairvoyant = _benchmark("clairvoyant")


def min_loads(calls, slots: dict[int, int], experts: int, pooled: bool) -> int:
    """Belady's MIN on the calls' experts (each distinct expert of a call one request),
    from the engine's warm start (each layer's first ``slots[layer]`` experts): on each
    layer's own calls at its slots, summed, or ``pooled``, on one cache of all of them."""
    layers = sorted(slots)
    if pooled:
        sequence = [layer * experts + e for layer, need in calls for _, e in sorted(need)]
        initial = [layer * experts + e for layer in layers for e in range(slots[layer])]
        return int(
            clairvoyant.belady_misses(sequence, [1] * len(sequence), sum(slots.values()), initial)
        )
    total = 0
    for layer in layers:
        sequence = [e for at, need in calls if at == layer for _, e in sorted(need)]
        initial = list(range(slots[layer]))
        total += clairvoyant.belady_misses(sequence, [1] * len(sequence), slots[layer], initial)
    return int(total)


@contextlib.contextmanager
def unjudged():
    """``markov`` with its prediction on at every call, whatever its judge finds (the
    judge's gain: this row against ``markov``)."""
    judge = bytes_judge.BytesJudge
    original = judge.serve

    def serve(self, *args):
        return original(self, *args)._replace(on=True)  # (its counters as they were)

    judge.serve = serve
    try:
        yield
    finally:
        judge.serve = original


@contextlib.contextmanager
def told_the_coming_steps(calls, layers: int, horizon: int):
    """``markov`` told, at each decode call, the experts its layer's next ``horizon``
    calls need (a perfect predictor of the coming steps): those of the next call go
    last, then those of the one after, and so on; the rest in ``lrfu``'s order. What
    any prediction of that many steps could save. The calls of :func:`replay` come one
    per layer per step, in order, so the ``n``-th call's next one is ``n + layers``."""
    experts = eviction.MarkovPolicy
    original = experts.on_routes
    made = iter(range(len(calls)))

    def on_routes(self, ids):
        at = next(made)
        self.next_demand = np.zeros(len(self.seen))
        for ahead in range(horizon, 0, -1):  # (the nearest last: it overwrites)
            if at + ahead * layers < len(calls):
                needed = [e for _, e in calls[at + ahead * layers][1]]
                self.next_demand[needed] = 1e9 * (horizon + 1 - ahead)

    experts.on_routes = on_routes
    try:
        yield
        assert next(made, None) is None, "a call of the replay did not reach the policy"
    finally:
        experts.on_routes = original


def replay(
    routes,
    batch: int,
    budget: float,
    experts: int,
    caches,
    half_lives=(),
    predicted: list | None = None,
    region_caches=(),
    horizons=(),
) -> list[dict]:
    """Loads of each cache (and of ``lrfu`` at each half-life) and of both bounds, for the
    first ``batch`` requests decoding together. ``predicted``: the path predictor's
    routes per request (``[S, L*E]`` bool), what ``plec`` plans each step by; ``plec``
    also runs on the true routes (a perfect predictor). ``region_caches``: those caches
    again with the experts on disk, where a call of more experts than a layer's slots
    goes through the shared region (as on the disk tier; its rows are not in the MINs).
    ``horizons``: ``markov`` again, told the routes of that many coming steps
    (:func:`told_the_coming_steps`)."""
    routes = routes[:batch]
    steps = routes[0].shape[0]
    schedule = cache_bound.schedule_all(batch, steps)
    calls = cache_bound.calls_of(schedule, routes)
    believed = cache_bound.true_sets(routes, experts)
    loads: dict[str, int] = {}
    slots: dict[int, int] = {}

    def run(name: str, cache: str, told=believed, disk: bool = False) -> None:
        stats = cache_bound.engine_replay(schedule, routes, told, cache, budget, experts, disk=disk)
        loads[name] = stats["total"]["decode"]["loads"]
        if not slots:  # (a fixed count per layer: the first cache's; plec shares one pool)
            per_layer = stats["slots_per_layer"]
            names = sorted(per_layer, key=lambda name: int(name.split(".")[2]))
            slots.update({index: per_layer[name] for index, name in enumerate(names)})

    for cache in caches:
        run(cache, cache)
    if "markov" in caches:
        with unjudged():
            run("markov, prediction always on", "markov")
    for cache in region_caches:
        run(f"{cache}, disk (region)", cache, disk=True)
    if predicted is not None:
        run("plec, path predictor", "plec", predicted[:batch])
        run("plec, true routes", "plec")
    for horizon in horizons:
        with told_the_coming_steps(calls, routes[0].shape[1], horizon):
            run(f"told the next {horizon} steps", "markov")
    default = eviction.LRFU_HALF_LIFE
    try:
        for half_life in half_lives:
            eviction.LRFU_HALF_LIFE = half_life
            run(f"lrfu, half-life {half_life:g}", "lrfu")
    finally:
        eviction.LRFU_HALF_LIFE = default
    loads["min (per layer)"] = min_loads(calls, slots, experts, pooled=False)
    loads["min (pooled)"] = min_loads(calls, slots, experts, pooled=True)
    bound = loads["min (per layer)"]
    gap = loads.get("lru", 0) - bound
    return [
        {
            "batch": batch,
            "budget": budget,
            "cache": cache,
            "slots_per_layer": slots[0],
            "loads": count,
            "loads_per_token": count / (batch * steps),
            "vs_min": count / bound if bound else None,
            "vs_lru": count / loads["lru"] if loads.get("lru") else None,
            "gap_closed": (loads["lru"] - count) / gap if gap > 0 else None,
        }
        for cache, count in loads.items()
    ]


def markdown(rows: list[dict]) -> str:
    lines = [
        "| batch | budget | slots a layer | cache | loads a token | x MIN (per layer) | x LRU "
        "| share of LRU's gap to MIN closed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['vs_lru']:.3f}" if r["vs_lru"] is not None else ""
        closed = f"{r['gap_closed']:.2f}" if r.get("gap_closed") is not None else ""
        lines.append(
            f"| {r['batch']} | {r['budget']} | {r['slots_per_layer']} | {r['cache']} | "
            f"{r['loads_per_token']:.2f} | "
            f"{r['vs_min']:.3f} | {ratio} | {closed} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument("--caches", nargs="+", default=["lru", "lfu", "lrfu", "markov"])
    parser.add_argument("--half-lives", type=float, nargs="*", default=[])
    parser.add_argument("--region-caches", nargs="*", default=["lru", "lrfu", "markov"])
    parser.add_argument("--horizons", type=int, nargs="*", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--name", default="residency_bound")
    args = parser.parse_args()

    model_dir = str(model_path(DEFAULT_MODEL))
    from transformers import AutoConfig

    experts = AutoConfig.from_pretrained(model_dir).num_local_experts
    routes, tokens = record_routes(model_dir, held_out_prompts(max(args.batches)), args.max_tokens)
    layers = routes[0].shape[1]
    predicted = cache_bound.predicted_sets(tokens, layers, experts)
    rows = []
    for budget in args.budgets:
        for batch in args.batches:
            rows += replay(
                routes, batch, budget, experts, args.caches, args.half_lives, predicted,
                args.region_caches, args.horizons,
            )  # fmt: skip
            print(markdown([r for r in rows if r["batch"] == batch and r["budget"] == budget]))
    result = {
        "model": model_dir,
        "max_tokens": args.max_tokens,
        "lrfu_half_life": eviction.LRFU_HALF_LIFE,
        "rows": rows,
    }
    path = write_result(args.name, result)
    path.with_suffix(".md").write_text(markdown(rows) + f"\n`{command_line()}`\n")
    print(f"wrote {path}\ncommand: {command_line()}")


if __name__ == "__main__":
    main()
