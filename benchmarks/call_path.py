"""The path of one decode layer call through the package: which modules it enters, how
often, and how many times it climbs into a higher layer of the package.

    python benchmarks/call_path.py [--name call_path]

A toy engine on the CPU (two layers of 16 experts, top-2, ``fetch``) in each of
:data:`CASES`; after warm-up calls, one decode call of the first layer is traced with
``sys.setprofile`` (the link's copy thread is not traced). The resident case is also
timed (real time, the engine's path with a kernel that does nothing: µs a call, the
fastest of 7 rounds of 2000 calls). A module is
*entered* when a call goes from a frame of another package module (or from outside the
package) into one of its functions; the call's own entry into ``engine`` counts; an
entry *climbs* when the module entered stands on a higher layer of the package's map
(``vllm_specexpert/__init__.py``; a folder such as ``tiers/`` is one layer) than its
caller. Reported: entries per module, distinct modules, climbs (caller, function
entered), the package's objects the call made (by class: an ``__init__`` of it ran), and
the package's line count (``wc -l`` of its ``.py`` files, tools excluded). Run it on two
checkouts (``PYTHONPATH=<checkout>``) to compare a redesign before and after. Writes
``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO / "tests"))  # (the toy layer and kernel of the tests)

from moe_reference import random_layer, random_routing, slot_kernel  # noqa: E402
from test_layout import layer_of, relation_map  # noqa: E402 (the package map's layers)

import vllm_specexpert  # noqa: E402
from vllm_specexpert.config import SpecExpertConfig  # noqa: E402
from vllm_specexpert.engine import OffloadEngine  # noqa: E402
from vllm_specexpert.layer_call import LayerCall  # noqa: E402
from vllm_specexpert.phases import PassPhases  # noqa: E402

PACKAGE = Path(vllm_specexpert.__file__).resolve().parent


def module_of(filename: str) -> str | None:
    path = Path(filename)
    try:
        relative = path.resolve().relative_to(PACKAGE)
    except ValueError:
        return None
    return ".".join(relative.with_suffix("").parts)


def trace_call(
    engine: OffloadEngine, request: LayerCall
) -> tuple[collections.Counter, collections.Counter, collections.Counter, collections.Counter]:
    """(module -> times the call entered it from elsewhere, ``module:function`` -> the
    same by the function entered, package class -> objects of it the call made,
    ``caller -> module:function`` -> the entries that climb: into a module on a higher
    layer of the package map than the caller's)."""
    entered: collections.Counter = collections.Counter()
    by_function: collections.Counter = collections.Counter()
    made: collections.Counter = collections.Counter()
    climbs: collections.Counter = collections.Counter()
    layers = relation_map()

    def profile(frame, event, arg):
        if event != "call":
            return
        if frame.f_code.co_name == "__init__":  # (a dataclass's is written "<string>")
            cls = type(frame.f_locals.get("self"))
            if cls.__module__.startswith(PACKAGE.name):
                made[cls.__name__] += 1
        module = module_of(frame.f_code.co_filename)
        if module is None:
            return
        caller = frame.f_back
        came_from = module_of(caller.f_code.co_filename) if caller is not None else None
        if came_from != module:
            entered[module] += 1
            by_function[f"{module}:{frame.f_code.co_name}"] += 1
            if came_from is not None and layer_of(f"{PACKAGE.name}.{module}", layers) > layer_of(
                f"{PACKAGE.name}.{came_from}", layers
            ):
                climbs[f"{came_from} -> {module}:{frame.f_code.co_name}"] += 1

    sys.setprofile(profile)
    try:
        engine.run_call(request)
    finally:
        sys.setprofile(None)
    return entered, by_function, made, climbs


def package_lines() -> int:
    return sum(
        len(path.read_text().splitlines())
        for path in PACKAGE.rglob("*.py")
        if "tools" not in path.relative_to(PACKAGE).parts
    )


CASES = {
    "resident": (1.0, "none", 1),
    "misses": (0.5, "none", 4),
    "misses, router predictor": (0.5, "router", 4),
}
"""Case -> (budget, predictor, tokens): every expert resident; a partial budget with
misses (``fetch``); the same with next-layer prediction and its prefetch."""


def no_kernel(x, weights, ids, slots, expert_map, *, out=None, tile_tokens=0):
    return x  # (the engine's path alone is timed)


def time_calls(engine: OffloadEngine, request: LayerCall, calls: int = 2000) -> float:
    """Seconds per call of ``request`` with a kernel that does nothing (the engine's
    path alone; every expert resident: each call the same work), the fastest of 7
    rounds of ``calls`` (the machine's other loads only add)."""
    request = dataclasses.replace(request, kernel=no_kernel)
    rounds = []
    for _ in range(7):
        started = time.perf_counter()
        for _ in range(calls):
            request.phases = PassPhases.decode_only(request.num_tokens)
            engine.run_call(request)
        rounds.append((time.perf_counter() - started) / calls)
    return min(rounds)


def trace_case(budget: float, predictor: str, tokens: int) -> dict:
    config = SpecExpertConfig.from_dict(
        {"budget": budget, "miss_policy": "fetch", "predictor": predictor}
    )
    engine = OffloadEngine(config, torch.device("cpu"), reports=False)
    engine.budget.sizing.moe_layers = 2
    names = ["l0", "l1"]
    for index, name in enumerate(names):
        engine.add_layer(name, random_layer(seed=index), top_k=2, index=index)
    engine.link_layers("l0", "l1")
    engine.start()
    try:
        for seed in range(8):  # warm-up: caches filled, predictions made
            for name in names:
                x, w, ids = random_routing(tokens, 16, 2, seed=seed)
                engine.run_call(
                    LayerCall(name, slot_kernel, x, w, ids, PassPhases.decode_only(tokens))
                )
        x, w, ids = random_routing(tokens, 16, 2, seed=99)
        request = LayerCall("l0", slot_kernel, x, w, ids, PassPhases.decode_only(tokens))
        before = engine.layers["l0"].stats.decode.missed_entries
        entered, by_function, made, climbs = trace_call(engine, request)
        missed = engine.layers["l0"].stats.decode.missed_entries - before
        seconds = time_calls(engine, request) if budget == 1.0 else None
    finally:
        engine.close()
    return {
        "budget": budget,
        "predictor": predictor,
        "tokens": tokens,
        "missed_entries": int(missed),
        "modules_entered": dict(entered.most_common()),
        "functions_entered": dict(by_function.most_common()),
        "distinct_modules": len(entered),
        "entries": int(sum(entered.values())),
        "most_entered": int(max(entered.values())),
        "objects_made": dict(made.most_common()),
        "climbs": dict(climbs.most_common()),
        "us_per_call": seconds * 1e6 if seconds is not None else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="call_path")
    args = parser.parse_args()
    result = {
        "command": " ".join(["python", *sys.argv]),
        "cases": {case: trace_case(*settings) for case, settings in CASES.items()},
        "package_lines": package_lines(),
    }
    out = REPO / "benchmarks" / "results" / f"{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for case, traced in result["cases"].items():
        print(
            f"{case}: {traced['distinct_modules']} modules entered {traced['entries']} times "
            f"(most {traced['most_entered']}), {sum(traced['climbs'].values())} climbs up, "
            f"{traced['missed_entries']} missed entries; "
            f"objects {traced['objects_made']}"
            + (f"; {traced['us_per_call']:.2f} us a call" if traced["us_per_call"] else "")
        )
        print(f"  {traced['modules_entered']}")
        if traced["climbs"]:
            print(f"  climbs: {traced['climbs']}")
    print(f"package lines: {result['package_lines']}\nwrote {out}\n{result['command']}")


if __name__ == "__main__":
    main()
