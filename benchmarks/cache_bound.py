"""How few expert bytes can batched decode move at all? A clairvoyant bound for the
token scheduler and the predictive cache (issue 12's "20 % fewer bytes than LRU").

    python benchmarks/cache_bound.py [--batch 32] [--budget 0.25] [--max-tokens 16]
                                     [--group-size 16] [--max-wait-steps 4]

Under ``fetch`` every request's routes are fixed by its greedy tokens, whatever the
schedule or the cache. So this script records them once, per request and decode token
(transformers, fp32, greedy; ``--max-tokens`` per request, the first from prefill as in
vLLM), and replays them offline under

- **schedules**: ``all`` (every running request every step, vLLM's default) and
  ``grouped`` (the token scheduler's rule: at most ``group_size`` per step chosen by
  :func:`~vllm_specexpert.schedule.grouping.partition`, held-back requests skip one step,
  none waits more than ``max_wait_steps``), once with the path predictor's routes (what
  the scheduler sees) and once with the true routes (an oracle grouping);
- **caches** at the same total slots (``budget`` x experts x layers): ``lru`` (a pool per
  layer; a call is served in token order, so a call that needs more experts than its
  pool reloads within the call, as the executor's token groups do), ``global-lru`` (one
  pool, LRU), ``min-shared`` (one pool, clairvoyant: a call's experts all resident
  together and, on a miss, the victim is the expert whose next call is farthest, Belady's
  rule at call granularity: the best any cache that holds a call's experts at once can do,
  PLEC with a perfect predictor included) and ``min-layer`` (the same, a pool per layer).

Writes ``benchmarks/results/cache_bound.json``: loads and MB per decode token for every
(schedule, cache), and the ratio to ``lru`` on ``all``. No timing, no emulated link: the
figures are counts on the recorded routes.
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, held_out_prompts, write_result  # noqa: E402

from vllm_specexpert.schedule.grouping import partition  # noqa: E402
from vllm_specexpert.tools.fixtures import ASSETS, DEFAULT_MODEL, model_path  # noqa: E402
from vllm_specexpert.tools.trace import _LayerHooks, load_model  # noqa: E402


def record_routes(model_dir: str, prompts: list[str], max_tokens: int):
    """``(routes, tokens)``: ``routes[i]`` is ``[max_tokens - 1, L, K]``, the experts of
    request ``i``'s decode steps (the token fed at each); ``tokens[i]`` its ids so far
    at each step (prompt + outputs), for the path predictor."""
    model, tokenizer = load_model(model_dir)
    hooks = _LayerHooks(model)
    routes, tokens = [], []
    try:
        for prompt in prompts:
            ids = tokenizer(prompt)["input_ids"]
            with torch.no_grad():
                out = model(input_ids=torch.tensor([ids]), use_cache=True)
                past, token = out.past_key_values, int(out.logits[0, -1].argmax())
                steps, contexts = [], []
                for _ in range(max_tokens - 1):
                    ids = ids + [token]
                    contexts.append(list(ids))
                    out = model(input_ids=torch.tensor([[token]]), past_key_values=past,
                                use_cache=True)
                    past, token = out.past_key_values, int(out.logits[0, -1].argmax())
                    steps.append(hooks.stacked(1)["topk_ids"][0])  # [L, K]
            routes.append(torch.stack(steps).numpy())
            tokens.append(contexts)
    finally:
        hooks.remove()
    return routes, tokens


Step = tuple[list[tuple[int, int]], list[tuple[int, int]] | None]
"""One decode step: the ``(request, decode index)`` entries it runs, and those the
scheduler expects to run next (``None`` when it does not group)."""


def schedule_all(n: int, steps: int) -> list[Step]:
    """Every request every step (vLLM's default)."""
    return [([(i, s) for i in range(n)], None) for s in range(steps)]


def schedule_grouped(route_sets: list[np.ndarray], steps: int, group_size: int,
                     max_wait_steps: int) -> list[Step]:
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


def needed_sets(run: list[tuple[int, int]], routes: list[np.ndarray], layer: int) -> set:
    return {(layer, int(e)) for i, s in run for e in routes[i][s, layer]}


def calls_of(schedule: list[Step], routes: list[np.ndarray]) -> list[tuple[int, set]]:
    """The layer calls of a schedule, in order: ``(layer, {(layer, expert)})``."""
    layers = routes[0].shape[1]
    return [(layer, needed_sets(run, routes, layer))
            for run, _ in schedule for layer in range(layers)]


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


def plec_loads(schedule: list[Step], routes: list[np.ndarray], believed: list[np.ndarray],
               slots: int, experts: int) -> int:
    """The engine's ``cache: plec`` rule (no preload), one pool: the victim is the
    resident with the fewest uses still to come by ``believed`` routes (this step's for
    layers not run yet, the expected next group's for layers that ran; without one, this
    step's), least recently used among equals."""
    layers = routes[0].shape[1]

    def counts(entries):
        return sum(believed[i][s] for i, s in entries).reshape(layers, experts)

    pool: dict = {}  # key -> last use
    clock = loads = 0
    for run, expected in schedule:
        lookahead = counts(run).astype(np.float64)
        following = counts(expected) if expected else None
        for layer in range(layers):
            need = needed_sets(run, routes, layer)
            missing = [k for k in need if k not in pool]
            loads += len(missing)
            overflow = len(pool) + len(missing) - slots
            if overflow > 0:
                victims = sorted((k for k in pool if k not in need),
                                 key=lambda k: (lookahead[k], pool[k]))
                for k in victims[:overflow]:
                    del pool[k]
            for k in need:
                clock += 1
                pool[k] = clock
            if following is not None:
                lookahead[layer] = following[layer]
    return loads


def engine_loads(schedule: list[Step], routes: list[np.ndarray],
                 believed: list[np.ndarray], cache: str, budget: float,
                 experts: int) -> int:
    """The plugin's own engine (``fetch``, no vLLM) replaying the schedule, as the
    scheduler would drive it: each step's ``StepDemand`` from the ``believed`` routes,
    every layer called with the step's true routes. Tiny random weights: only the loads
    are counted."""
    from vllm_specexpert.config import SpecExpertConfig
    from vllm_specexpert.engine import OffloadEngine
    from vllm_specexpert.phases import StepDemand

    layers, top_k = routes[0].shape[1], routes[0].shape[2]
    config = SpecExpertConfig.from_dict({"budget": budget, "cache": cache,
                                         "path_predictor": "(replayed)"})
    engine = OffloadEngine(config, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    names = [f"model.layers.{i}.mlp.experts" for i in range(layers)]
    for index, name in enumerate(names):
        engine.add_layer(name, {"w13_weight": torch.randn(experts, 32, 16, generator=g).bfloat16(),
                                "w2_weight": torch.randn(experts, 16, 16, generator=g).bfloat16()},
                         top_k=top_k, index=index)
    engine.start()

    def counts(entries):
        total = sum(believed[i][s] for i, s in entries).reshape(layers, experts)
        return {layer: total[layer].astype(np.int64) for layer in range(layers)}

    def kernel(x, topk_weights, ids, slots, expert_map=None):
        return torch.zeros_like(x)

    for run, expected in schedule:
        engine.step_demand = StepDemand(tokens=len(run), layers=counts(run),
                                        next_layers=counts(expected) if expected else None)
        for layer, name in enumerate(names):
            ids = torch.from_numpy(np.stack([routes[i][s, layer] for i, s in run])).to(torch.int32)
            x = torch.zeros(len(run), 16, dtype=torch.bfloat16)
            engine.run(name, kernel, x, torch.full(ids.shape, 1 / top_k), ids)
    loads = engine.stats()["total"]["decode"]["loads"]
    engine.close()
    return loads


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--max-wait-steps", type=int, default=4)
    parser.add_argument("--name", default="cache_bound")
    args = parser.parse_args()

    model_dir = str(model_path(DEFAULT_MODEL))
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    experts, layers = hf.num_local_experts, hf.num_hidden_layers
    expert_mb = 3 * hf.hidden_size * hf.moe_intermediate_size * 2 / 1e6  # bf16
    slots_per_layer = int(args.budget * experts)
    total_slots = slots_per_layer * layers

    routes, tokens = record_routes(model_dir, held_out_prompts(args.batch), args.max_tokens)
    steps = args.max_tokens - 1
    decode_tokens = args.batch * steps
    believed = {"predicted": predicted_sets(tokens, layers, experts),
                "true": true_sets(routes, experts)}
    schedules = {"all": schedule_all(args.batch, steps)}
    for name, sets in believed.items():
        schedules[f"grouped ({name} routes)"] = schedule_grouped(
            sets, steps, args.group_size, args.max_wait_steps)
    caches = {
        "lru": lambda schedule: lru_loads(calls_of(schedule, routes), slots_per_layer, True),
        "global-lru": lambda schedule: lru_loads(calls_of(schedule, routes), total_slots,
                                                 False),
        "plec": lambda schedule: plec_loads(schedule, routes, believed["predicted"],
                                            total_slots, experts),
        "plec (true routes)": lambda schedule: plec_loads(schedule, routes, believed["true"],
                                                          total_slots, experts),
        "min-shared": lambda schedule: min_loads(calls_of(schedule, routes), total_slots),
        "engine lru": lambda schedule: engine_loads(schedule, routes, believed["predicted"],
                                                    "lru", args.budget, experts),
        "engine plec": lambda schedule: engine_loads(schedule, routes, believed["predicted"],
                                                     "plec", args.budget, experts),
        "engine plec (true routes)": lambda schedule: engine_loads(
            schedule, routes, believed["true"], "plec", args.budget, experts),
    }
    rows = []
    for schedule_name, schedule in schedules.items():
        needed = sum(len(need) for _, need in calls_of(schedule, routes)) / len(schedule)
        for cache_name, count in caches.items():
            loads = count(schedule)
            rows.append({
                "schedule": schedule_name, "cache": cache_name, "steps": len(schedule),
                "needed_per_step": needed, "loads": loads,
                "mb_per_token": loads * expert_mb / decode_tokens,
            })
    base = next(r["loads"] for r in rows if r["schedule"] == "all" and r["cache"] == "lru")
    for r in rows:
        r["vs_lru_all"] = r["loads"] / base
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
    path = write_result(args.name, {
        "model": model_dir, "batch": args.batch, "budget": args.budget,
        "max_tokens": args.max_tokens, "decode_tokens": decode_tokens,
        "slots_per_layer": slots_per_layer, "total_slots": total_slots,
        "expert_mb": expert_mb,
        "token_scheduler": {"group_size": args.group_size,
                            "max_wait_steps": args.max_wait_steps},
        "rows": rows,
    })
    print(f"wrote {path}\ncommand: {command_line()}")


if __name__ == "__main__":
    main()
