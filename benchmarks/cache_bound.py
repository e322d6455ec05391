"""How few expert bytes can batched decode move at all? The plugin's caches against a
clairvoyant bound, with and without the token scheduler's grouping (issue 12's "20 %
fewer bytes than LRU").

    python benchmarks/cache_bound.py [--batches 32 64] [--budgets 0.25 0.5]
                                     [--max-tokens 16] [--group-size 16] [--max-wait-steps 4]

Under ``fetch`` every request's routes are fixed by its greedy tokens, whatever the
schedule or the cache. So this script records them once, per request and decode token
(transformers, fp32, greedy, held-out prompts; ``--max-tokens`` per request, the first
from prefill as in vLLM), and replays them offline under

- **schedules**: ``all`` (every running request every step, vLLM's default) and
  ``grouped`` (the token scheduler's rule: at most ``group_size`` requests per step, chosen
  by :func:`~vllm_specexpert.schedule.grouping.partition`, none held back more than
  ``max_wait_steps``), grouped by the path predictor's routes (what the scheduler sees)
  and by the true ones (an oracle grouping);
- **caches** at the same total slots (``budget`` x experts x layers):
  - ``lru (engine)``, ``plec (engine)``: the plugin's own engine (no vLLM), driven as the
    scheduler drives it (each step's predicted demand, the next group's under grouping);
    ``plec (engine, true routes)``: the same with a perfect next-step predictor;
    ``stream (engine)``: ``miss_policy: stream`` on LRU (each missing expert read once
    per call: what ``lru once per call`` counts, by the engine itself);
  - ``lru once per call``: a pool per layer, LRU, each missed expert loaded once per call
    (what an executor that may split a token's experts over kernel calls could do; the
    exact one runs whole tokens, so a call larger than its pool reloads);
  - ``global lru``: one pool, LRU across layers;
  - ``belady``: one pool, clairvoyant: a call's experts resident together and, on a
    miss, the victim is the expert whose next call is farthest (Belady's rule at call
    granularity). No cache that runs each call at once, whatever it predicts or loads
    ahead, loads fewer on the same schedule.

Writes ``benchmarks/results/cache_bound.json`` and ``cache_bound.png``: loads and MB per
decode token of every (schedule, cache), and the ratio to ``lru (engine)`` on ``all``.
No timing and no link: counts on the recorded routes.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, command_line, held_out_prompts, write_result

from specexpert_testbed.fixtures import DEFAULT_MODEL, model_path
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.schedule.grouping import partition
from vllm_specexpert.tools.embedded_model import ASSETS
from vllm_specexpert.tools.trace import record_routes

Step = tuple[list[tuple[int, int]], list[tuple[int, int]] | None]
"""One decode step: the ``(request, decode index)`` entries it runs, and those the
scheduler expects to run next (``None`` when it does not group)."""


def schedule_all(n: int, steps: int) -> list[Step]:
    """Every request every step (vLLM's default)."""
    return [([(i, s) for i in range(n)], None) for s in range(steps)]


def schedule_grouped(
    route_sets: list[np.ndarray], steps: int, group_size: int, max_wait_steps: int
) -> list[Step]:
    """The token scheduler's rule on ``route_sets[i][s]`` (``[P]`` bool, the routes it
    believes request ``i``'s decode ``s`` takes)."""
    n = len(route_sets)
    done = [0] * n
    waited = [0] * n
    out = []
    while any(d < steps for d in done):
        decoding = [i for i in range(n) if done[i] < steps]
        run, expected = decoding, None
        if len(decoding) > group_size:
            routes = np.stack([route_sets[i][done[i]] for i in decoding])
            w = np.array([waited[i] for i in decoding])
            groups = partition(routes, group_size, priority=w, required=w >= max_wait_steps)
            run = [decoding[j] for j in groups[0]]
            expected = [(decoding[j], done[decoding[j]]) for j in groups[1]]
            for i in set(decoding) - set(run):
                waited[i] += 1  # held back this step only
        for i in run:
            waited[i] = 0
        out.append(([(i, done[i]) for i in run], expected))
        for i in run:
            done[i] += 1
    return out


def schedule_verified(n: int, steps: int, k: int) -> list[Step]:
    """Draft lookahead with every drafted token accepted: each step runs ``k + 1``
    consecutive decode tokens of every request (one verification pass)."""
    return [
        ([(i, s) for i in range(n) for s in range(t, min(t + k + 1, steps))], None)
        for t in range(0, steps, k + 1)
    ]


def draft_sets(routes: list[np.ndarray], experts: int, k: int) -> list[np.ndarray]:
    """What a lookahead draft of ``k`` tokens tells the cache about a verification
    step: the true routes of each request's first ``k`` tokens of the step, none for its
    last (the draft never runs its last drafted token)."""
    sets = true_sets(routes, experts)
    for each in sets:
        each[k :: k + 1] = False
    return sets


def needed_sets(run: list[tuple[int, int]], routes: list[np.ndarray], layer: int) -> set:
    return {(layer, int(e)) for i, s in run for e in routes[i][s, layer]}


def calls_of(schedule: list[Step], routes: list[np.ndarray]) -> list[tuple[int, set]]:
    """The layer calls of a schedule, in order: ``(layer, {(layer, expert)})``."""
    layers = routes[0].shape[1]
    return [
        (layer, needed_sets(run, routes, layer)) for run, _ in schedule for layer in range(layers)
    ]


def lru_loads(calls, slots: int, per_layer: bool) -> int:
    """LRU; a call loads each expert it misses once (its hits are touched first, so a
    call larger than the pool evicts what it has used already)."""
    pools: dict[int, OrderedDict] = {}
    loads = 0
    for layer, need in calls:
        pool = pools.setdefault(layer if per_layer else 0, OrderedDict())
        hits = [k for k in need if k in pool]
        for k in hits:
            pool.move_to_end(k)
        for k in need - set(hits):
            loads += 1
            if len(pool) >= slots:
                pool.popitem(last=False)
            pool[k] = True
    return loads


def min_loads(calls, slots: int) -> int:
    """Belady at call granularity, one pool: a call's experts resident together; on a
    miss evict the resident (not needed now) whose next call comes last."""
    next_use: list[dict] = [None] * len(calls)
    upcoming: dict = {}
    for c in range(len(calls) - 1, -1, -1):
        need = calls[c][1]
        next_use[c] = {k: upcoming.get(k, np.inf) for k in need}
        for k in need:
            upcoming[k] = c
    pool: dict = {}  # key -> index of the next call needing it
    loads = 0
    for c, (_, need) in enumerate(calls):
        missing = [k for k in need if k not in pool]
        loads += len(missing)
        overflow = len(pool) + len(missing) - slots
        if overflow > 0:
            victims = sorted((k for k in pool if k not in need), key=lambda k: -pool[k])
            for k in victims[:overflow]:
                del pool[k]
        for k in need:
            pool[k] = next_use[c][k]
    return loads


def engine_loads(
    schedule: list[Step],
    routes: list[np.ndarray],
    believed: list[np.ndarray],
    cache: str,
    budget: float,
    experts: int,
    miss_policy: str = "fetch",
) -> int:
    """The decode loads of :func:`engine_replay`."""
    stats = engine_replay(schedule, routes, believed, cache, budget, experts, miss_policy)
    return stats["total"]["decode"]["loads"]


def engine_replay(
    schedule: list[Step],
    routes: list[np.ndarray],
    believed: list[np.ndarray],
    cache: str,
    budget: float,
    experts: int,
    miss_policy: str = "fetch",
    disk: bool = False,
) -> dict:
    """The plugin's own engine (``fetch``, no vLLM) replaying the schedule, as the
    scheduler would drive it: each step's ``StepDemand`` from the ``believed`` routes,
    every layer called with the step's true routes; its stats at the end. Tiny random
    weights: only the counts mean anything. ``disk``: the experts in a pack on disk, read
    with the slots residency, so that a call of more experts than a layer's slots goes
    through the shared region (``fetch``, a pool per layer), as on the disk tier."""
    from vllm_specexpert.config import SpecExpertConfig

    layers, top_k = routes[0].shape[1], routes[0].shape[2]
    config = SpecExpertConfig.from_dict(
        {
            "budget": budget,
            "cache": cache,
            "miss_policy": miss_policy,
            "path_predictor": "(replayed)",
        }
    )
    on_disk = max(len(run) for run, _ in schedule) if disk else None
    with replay_engine(config, layers, experts, top_k, on_disk) as (engine, names):
        return _replayed(engine, schedule, routes, believed, names, layers, experts, top_k)


@contextlib.contextmanager
def replay_engine(
    config, layers: int, experts: int, top_k: int, on_disk: int | None = None
) -> Iterator[tuple]:
    """``(engine, names)``: the plugin's engine (no vLLM) on ``layers`` MoE layers of
    tiny random experts, started. ``on_disk``: the experts in a pack on disk, read with
    the slots residency, the engine sized for that many sequences (``max_num_seqs``, as
    vLLM's adapter tells it: the shared region where a call may need more than a
    layer's slots); else in host memory."""
    from vllm_specexpert.engine import OffloadEngine

    engine = OffloadEngine(config, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    names = [f"model.layers.{i}.mlp.experts" for i in range(layers)]
    weights = {
        name: {
            "w13_weight": torch.randn(experts, 32, 16, generator=g).bfloat16(),
            "w2_weight": torch.randn(experts, 16, 16, generator=g).bfloat16(),
        }
        for name in names
    }
    with contextlib.ExitStack() as held:
        sources = weights if on_disk is None else _on_disk(engine, weights, held, on_disk)
        for index, name in enumerate(names):
            engine.add_layer(name, sources[name], top_k=top_k, index=index)
        engine.start()
        yield engine, names


def _on_disk(engine, weights: dict, held: contextlib.ExitStack, max_num_seqs: int) -> dict:
    """``weights`` written to a pack in a directory removed after, the engine reading
    them from it (its sizing told the layers and the batch, as vLLM's adapter does)."""
    from vllm_specexpert.tiers.disk import Disk
    from vllm_specexpert.tiers.expert_pack import ExpertPack
    from vllm_specexpert.tiers.kernel_form import KernelForm
    from vllm_specexpert.tiers.pack_writer import write_pack

    out = Path(held.enter_context(tempfile.TemporaryDirectory())) / "pack"
    experts = next(iter(weights.values()))["w2_weight"].shape[0]
    write_pack(
        out,
        [(name, experts) for name in weights],
        lambda name, e: {k: t[e] for k, t in weights[name].items()},
        {"model": "replay", "checkpoint_files": []},
        KernelForm(layout="checkpoint", dtype="bfloat16"),
    )
    engine.budget.sizing.moe_layers = len(weights)
    engine.budget.sizing.max_num_seqs = max_num_seqs
    engine.store.tiers.append(Disk(ExpertPack(out), depth=2))
    return {name: engine.store.tier("disk").layer(name) for name in weights}


def _replayed(engine, schedule, routes, believed, names, layers, experts, top_k) -> dict:
    """Every step of ``schedule`` through ``engine`` (a kernel that computes nothing);
    its stats, once closed."""
    from vllm_specexpert.handoff import StepDemand

    def counts(entries):
        total = sum(believed[i][s] for i, s in entries).reshape(layers, experts)
        return {layer: total[layer].astype(np.int64) for layer in range(layers)}

    def kernel(x, topk_weights, ids, slots, expert_map=None, **_):
        return torch.zeros_like(x)

    step: dict[str, StepDemand] = {}
    engine.provide(step_demand=lambda: step.get("demand"))  # the scheduler's, per step
    for run, expected in schedule:
        step["demand"] = StepDemand(
            tokens=len(run), layers=counts(run), next_layers=counts(expected) if expected else None
        )
        for layer, name in enumerate(names):
            ids = torch.from_numpy(np.stack([routes[i][s, layer] for i, s in run])).to(torch.int32)
            x = torch.zeros(len(run), 16, dtype=torch.bfloat16)
            engine.run_call(LayerCall(name, kernel, x, torch.full(ids.shape, 1 / top_k), ids))
    stats = engine.stats()
    engine.close()
    return stats


def predicted_sets(tokens, layers: int, experts: int) -> list[np.ndarray]:
    """The path predictor's routes per request and decode step, ``[S, L*E]`` bool."""
    from vllm_specexpert.predict.path import load_path_predictor

    predictor = load_path_predictor(ASSETS / "tiny-qwen3-moe-path-predictor")
    out = []
    for contexts in tokens:
        with torch.no_grad():
            topk = predictor.predict_topk(predictor.windows_of(contexts))  # [S, L, K]
        sets = torch.zeros(len(contexts), layers, experts, dtype=torch.bool)
        sets.scatter_(-1, topk, True)
        out.append(sets.flatten(1).numpy())
    return out


def true_sets(routes: list[np.ndarray], experts: int) -> list[np.ndarray]:
    out = []
    for r in routes:
        sets = np.zeros((r.shape[0], r.shape[1], experts), dtype=bool)
        np.put_along_axis(sets, r, True, axis=-1)
        out.append(sets.reshape(r.shape[0], -1))
    return out


def cache_counts(
    routes: list[np.ndarray],
    believed: dict[str, list[np.ndarray]],
    budget: float,
    experts: int,
    layers: int,
) -> dict:
    """Each cache's loads on a schedule, by cache name: ``count(schedule, schedule_name)``
    (the engine's caches are told the routes the schedule believed, the predicted ones
    if it has none of its own)."""
    per_layer = int(budget * experts)
    return {
        "lru (engine)": lambda s, name: engine_loads(
            s, routes, believed.get(name, believed["predicted"]), "lru", budget, experts
        ),
        "plec (engine)": lambda s, name: engine_loads(
            s, routes, believed.get(name, believed["predicted"]), "plec", budget, experts
        ),
        "plec (engine, true routes)": lambda s, name: engine_loads(
            s, routes, believed["true"], "plec", budget, experts
        ),
        "stream (engine)": lambda s, name: engine_loads(
            s, routes, believed.get(name, believed["predicted"]), "lru", budget, experts, "stream"
        ),
        "lru once per call": lambda s, name: lru_loads(calls_of(s, routes), per_layer, True),
        "global lru": lambda s, name: lru_loads(calls_of(s, routes), per_layer * layers, False),
        "belady": lambda s, name: min_loads(calls_of(s, routes), per_layer * layers),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--max-wait-steps", type=int, default=4)
    parser.add_argument(
        "--lookahead-k",
        type=int,
        nargs="*",
        default=[],
        help="also replay draft lookahead's verification schedule with "
        "these draft lengths (every drafted token accepted)",
    )
    parser.add_argument("--name", default="cache_bound")
    args = parser.parse_args()

    model_dir = str(model_path(DEFAULT_MODEL))
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    experts, layers = hf.num_local_experts, hf.num_hidden_layers
    expert_mb = 3 * hf.hidden_size * hf.moe_intermediate_size * 2 / 1e6  # bf16
    all_routes, all_tokens = record_routes(
        model_dir, held_out_prompts(max(args.batches)), args.max_tokens
    )
    steps = args.max_tokens - 1
    rows = []
    for batch in args.batches:
        routes, tokens = all_routes[:batch], all_tokens[:batch]
        believed = {
            "predicted": predicted_sets(tokens, layers, experts),
            "true": true_sets(routes, experts),
        }
        schedules = {"all": schedule_all(batch, steps)}
        for name, sets in believed.items():
            schedules[f"grouped ({name} routes)"] = schedule_grouped(
                sets, steps, args.group_size, args.max_wait_steps
            )
        for k in args.lookahead_k:
            # The engine's demand for these steps is the draft's (k of k + 1 tokens).
            schedules[f"verified (lookahead k={k})"] = schedule_verified(batch, steps, k)
            believed[f"verified (lookahead k={k})"] = draft_sets(routes, experts, k)
        for budget in args.budgets:
            caches = cache_counts(routes, believed, budget, experts, layers)
            mine = []
            for schedule_name, schedule in schedules.items():
                calls = calls_of(schedule, routes)
                needed = sum(len(need) for _, need in calls) / len(schedule)
                for cache_name, count in caches.items():
                    loads = count(schedule, schedule_name)
                    mine.append(
                        {
                            "batch": batch,
                            "budget": budget,
                            "schedule": schedule_name,
                            "cache": cache_name,
                            "steps": len(schedule),
                            "needed_per_step": needed,
                            "loads": loads,
                            "mb_per_token": loads * expert_mb / (batch * steps),
                        }
                    )
            base = mine[0]["loads"]  # lru (engine) on all
            for row in mine:
                row["vs_lru"] = row["loads"] / base
                print(
                    {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()},
                    flush=True,
                )
            rows += mine
    result = {
        "model": model_dir,
        "batches": args.batches,
        "budgets": args.budgets,
        "max_tokens": args.max_tokens,
        "expert_mb": expert_mb,
        "token_scheduler": {"group_size": args.group_size, "max_wait_steps": args.max_wait_steps},
        "rows": rows,
    }
    path = write_result(args.name, result)
    plot(result, RESULTS / f"{args.name}.png")
    print(f"wrote {path} and {args.name}.png\ncommand: {command_line()}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos = [(b, c) for b in result["batches"] for c in result["budgets"]]
    fig, axes = plt.subplots(1, len(combos), figsize=(5 * len(combos), 4.5), squeeze=False)
    for ax, (batch, budget) in zip(axes[0], combos, strict=True):
        rows = [r for r in result["rows"] if r["batch"] == batch and r["budget"] == budget]
        schedules = list(dict.fromkeys(r["schedule"] for r in rows))
        caches = list(dict.fromkeys(r["cache"] for r in rows))
        width = 0.8 / len(caches)
        for j, cache in enumerate(caches):
            values = [
                next(r["vs_lru"] for r in rows if r["schedule"] == s and r["cache"] == cache)
                for s in schedules
            ]
            ax.bar(np.arange(len(schedules)) + j * width, values, width, label=cache)
        ax.axhline(0.8, color="black", linestyle="--", linewidth=1, label="-20 %")
        ax.set_xticks(np.arange(len(schedules)) + 0.4 - width / 2)
        ax.set_xticklabels(schedules, fontsize=7)
        ax.set(
            title=f"{batch} sequences, budget {budget}",
            ylabel="expert bytes per decode token / lru (engine), all",
        )
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"recorded routes replayed; {command_line()}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
