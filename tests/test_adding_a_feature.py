"""Adding a feature to the engine costs one new module under ``features/``, one line in
the registry and one word in the package's map; the engine is not touched.

Shown on a copy of the package: the test writes two features as their authors would, a
per-call tracer that adds a stage to each step of the layer's pipeline and wraps its run
step, and a place of its own that runs a missing expert as zeros; adds their lines, then
runs, in a fresh interpreter on the copy, the layout checks and toy engines with them on.
A feature that only watches changes nothing; the place's entries show in the plan's
output, the stats and the ``/metrics`` families with no other file touched."""

from pathlib import Path

import pytest
from package_copy import add_module, copy_package, edit, layout_check, report_of, run_in_copy

FEATURE_MODULE = '''"""Records each layer call's stages in order, with what each sees (always
on: a feature with its own setting would read it from ``parts.config``)."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.pipeline import DecodeCall, Part, Runner, RunWrap, Stage


class TracedRun(Runner):
    """The layer's run step (``mode``), its output's shape recorded."""

    def __init__(self, tracer: CallTracer, layer: OffloadedLayer, mode: Runner) -> None:
        self.tracer, self.layer, self.mode = tracer, layer, mode

    def run(self, call: DecodeCall | None, request: LayerCall):
        out = self.mode.run(call, request)
        self.tracer.events.append(("resolved", self.layer.name, list(out.shape)))
        return out


class CallTracer(EngineFeature):
    name = "tracer"

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.calls = 0

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        return cls()

    def stages(self, layer: OffloadedLayer) -> Sequence[Part]:
        def wrap(mode: Runner, exact: Runner) -> Runner:
            return TracedRun(self, layer, mode)

        return (
            Stage("tracer.call", "on_call", self._call),
            Stage("tracer.route", "route", self._route, uses=frozenset({"prediction"})),
            Stage("tracer.read", "plan", self._read),
            Stage("tracer.end", "finish", self._end),
            RunWrap("tracer.resolved", wrap),
        )

    def _call(self, request: LayerCall) -> None:
        self.events.append(("call", request.layer, request.num_tokens))

    def _route(self, call: DecodeCall) -> None:
        self.events.append(("route", call.layer.name, call.num_tokens, call.prediction))

    def _read(self, call: DecodeCall) -> None:
        self.events.append(("read", call.layer.name, call.router_host_ids.tolist()))

    def _end(self, call: DecodeCall) -> None:
        self.events.append(("end", call.layer.name))
        self.calls += 1

    def stats(self) -> dict:
        return {"calls": self.calls}

    def summary(self) -> str:
        return f", traced {self.calls} calls"

    def reset_stats(self) -> None:
        self.calls = 0


FEATURE = CallTracer
'''

PLACE_MODULE = '''"""Runs a missing expert as zeros, in a place of its own, when the adapter
provides the flag ``zeros_for_missing`` (a toy: the output changes)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.places import Place, PlaceCounters
from vllm_specexpert.policy import MissContext, MissPlan, MissPolicy
from vllm_specexpert.stats import counter


@dataclass
class ZeroCounters(PlaceCounters):
    entries_field = "zeros_entries"
    zeros_entries: int = counter("Missed entries run as zeros.")
    zeros_calls: int = counter("Layer calls that ran some entries as zeros.")


class ZeroPlace(Place):
    name = "zeros"
    counters = ZeroCounters

    def stage(self, call: LayerCall, entries: np.ndarray) -> LayerCall:
        return call

    def finish(self, call: LayerCall, out: torch.Tensor) -> None:
        call.stats.part(ZeroCounters).zeros_calls += 1
        return None  # (adds nothing: the experts' outputs are zeros)


class ZerosFirst(MissPolicy):
    def __init__(self, policy: MissPolicy, zeros: ZeroPlace) -> None:
        self.policy = policy
        self.zeros = zeros

    @property
    def spec(self):
        return self.policy.spec

    def plan(self, ids, resident, topk_weights, context: MissContext) -> MissPlan:
        return MissPlan(topk_ids=ids, places={self.zeros.name: ~resident[ids]})


class ZerosForMissing(EngineFeature):
    name = "zeros_for_missing"
    inputs = ("zeros_for_missing",)

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        return cls() if inputs.get("zeros_for_missing") else None

    def equip(self, layer: OffloadedLayer) -> None:
        layer.add_place(ZeroPlace())

    def unequip(self, layer: OffloadedLayer) -> None:
        layer.places.unregister(ZeroPlace.name)

    def miss_policy(self, policy: MissPolicy, layer: OffloadedLayer) -> MissPolicy:
        return ZerosFirst(policy, layer.places.of(ZeroPlace))


FEATURE = ZerosForMissing
'''

# Runs in the fresh interpreter, on the copy; prints what the parent asserts.
SCRIPT = """
import json, sys
import torch
import vllm_specexpert
from moe_reference import random_layer, random_routing, reference_moe, slot_kernel
from toy_engine import build_engine
from vllm_specexpert import metrics
from vllm_specexpert.features.call_tracer import CallTracer
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.phases import PassPhases

NAMES = [f"model.layers.{i}.mlp.experts" for i in range(2)]
LAYERS = {name: random_layer(seed=i) for i, name in enumerate(NAMES)}
report = {"package": vllm_specexpert.__file__}


def run(engine, tokens, steps=3, phases=PassPhases.decode_only):
    exact = True
    for step in range(steps):
        for name in NAMES:
            x, w, ids = random_routing(tokens, 16, 4, seed=step)
            out = engine.run_call(LayerCall(name, slot_kernel, x, w, ids, phases(tokens)))
            exact &= torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values()))
    return exact


for budget, tokens in ((0.25, 2), (1.0, 1)):  # one token at 1.0: the resident fast path
    engine = build_engine({"budget": budget}, LAYERS, top_k=4)
    exact = run(engine, tokens)
    tracer = engine.feature(CallTracer)
    report[f"budget {budget}"] = {
        "exact": exact,
        "events": tracer.events,
        "stats": engine.stats()["tracer"],
        "summary_end": engine.summary()[-len(", traced 6 calls"):],
    }
    engine.reset_stats()
    report[f"budget {budget}"]["after_reset"] = engine.stats()["tracer"]
    engine.close()

engine = build_engine({"budget": 0.25}, LAYERS, top_k=4)
run(engine, 5, steps=1, phases=PassPhases.prefill_only)
report["prefill_events"] = engine.feature(CallTracer).events
first = engine.feature(CallTracer)
engine.reconfigure(engine.config.changed({"miss_policy": "drop"}))
report["rebuilt"] = engine.feature(CallTracer) is not first
run(engine, 2, steps=1)
report["after_reconfigure"] = engine.stats()["tracer"]
engine.close()


def zeros_run(flag):
    # Decode calls at a quarter of the experts; what ran, against the reference with
    # the non-resident experts' entries left out (id -1).
    engine = build_engine({"budget": 0.25}, LAYERS, top_k=4)
    if flag:
        engine.provide(zeros_for_missing=True)
    as_expected, missing = True, 0
    for step in range(3):
        for name in NAMES:
            x, w, ids = random_routing(2, 16, 4, seed=step)
            resident = torch.from_numpy(engine.layers[name].cache.resident_mask())
            kept = torch.where(resident[ids.long()], ids, -1)
            missing += int((kept < 0).sum())
            out = engine.run_call(LayerCall(name, slot_kernel, x, w, ids))
            as_expected &= torch.equal(out, reference_moe(x, w, kept, *LAYERS[name].values()))
    stats = engine.stats()
    snapshot = {"rank": 0, "model_name": "toy", "series": engine.series()}
    families = {
        family.name: sorted((s.labels["layer"], s.labels["phase"], s.value) for s in family.samples)
        for family in metrics.supplied_families(["model_name", "engine"], [snapshot])
        if family.name.startswith("specexpert_zeros")
    }
    engine.close()
    return {
        "as_expected": as_expected,
        "missing": missing,
        "decode": {k: v for k, v in stats["total"]["decode"].items() if k.startswith("zeros")},
        "prefill": {k: v for k, v in stats["total"]["prefill"].items() if k.startswith("zeros")},
        "missed_entries": stats["total"]["decode"]["missed_entries"],
        "fetched_entries": stats["total"]["decode"]["fetched_entries"],
        "families": families,
    }


report["zeros"] = zeros_run(True)
report["no_flag"] = zeros_run(False)
print("REPORT " + json.dumps(report))
"""


def _add_feature(package: Path, name: str, module: str) -> None:
    """The whole cost of a feature: its module, its registry line, its word in the map."""
    last = '    "host_compute",\n'
    registry = ("features/__init__.py", last, f'{last}    "{name}",\n')
    add_module(package, f"features/{name}.py", module, registry)
    anchor = "handed over each step)"
    edit(package / "__init__.py", anchor, f"{anchor}, {name}")


@pytest.fixture(scope="module")
def copy_with_feature(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("copy")
    package = copy_package(root)
    _add_feature(package, "call_tracer", FEATURE_MODULE)
    _add_feature(package, "zeros_for_missing", PLACE_MODULE)
    return root


@pytest.fixture(scope="module")
def report(copy_with_feature) -> dict:
    return report_of(run_in_copy(copy_with_feature, "-c", SCRIPT))


def test_the_copy_with_the_feature_keeps_the_layout(copy_with_feature):
    done = layout_check(copy_with_feature)
    assert done.returncode == 0, done.stdout[-3000:]


# Slow: a package copy's layout check in a fresh interpreter, 30 s; the check itself runs on the
# package in test_layout.
@pytest.mark.slow
def test_the_layout_check_sees_a_feature_left_out_of_the_map(tmp_path):
    """The fault: the module and its registry line, without its word in the map."""
    (copy_package(tmp_path) / "features" / "call_tracer.py").write_text(FEATURE_MODULE)
    done = layout_check(tmp_path)
    assert done.returncode != 0 and "call_tracer" in done.stdout


@pytest.mark.parametrize("budget", ["0.25", "1.0"])
def test_the_tracer_sees_every_decode_call_in_stage_order_and_changes_nothing(report, budget):
    from moe_reference import random_routing

    assert "copy" in report["package"]  # the copy's package ran, not this one
    seen = report[f"budget {budget}"]
    assert seen["exact"]
    tokens = 1 if budget == "1.0" else 2
    expected = []
    for step in range(3):
        for i in range(2):
            name = f"model.layers.{i}.mlp.experts"
            ids = random_routing(tokens, 16, 4, seed=step)[2]
            expected += [
                ["call", name, tokens],
                ["route", name, tokens, None],
                ["read", name, ids.tolist()],
                ["resolved", name, [tokens, 32]],
                ["end", name],
            ]
    assert seen["events"] == expected
    assert seen["stats"] == {"calls": 6}
    assert seen["summary_end"] == ", traced 6 calls"
    assert seen["after_reset"] == {"calls": 0}


def test_prefill_calls_reach_only_the_stages_of_every_call(report):
    names = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert report["prefill_events"] == [["call", name, 5] for name in names]


def test_a_reconfigure_builds_the_feature_again(report):
    assert report["rebuilt"]
    assert report["after_reconfigure"] == {"calls": 2}


def test_a_new_place_runs_its_entries_and_shows_in_the_stats_and_metrics(report):
    zeros = report["zeros"]
    # The plan gave every missing entry to the place: its output is the reference's
    # without those experts, nothing was fetched, and the place counted each entry.
    assert zeros["missing"] > 0 and zeros["as_expected"]
    assert zeros["fetched_entries"] == 0
    assert zeros["decode"]["zeros_entries"] == zeros["missed_entries"] == zeros["missing"]
    assert 0 < zeros["decode"]["zeros_calls"] <= 6
    assert zeros["prefill"] == {"zeros_entries": 0, "zeros_calls": 0}
    entries = zeros["families"]["specexpert_zeros_entries"]
    assert {(layer, phase) for layer, phase, _ in entries} == {
        (layer, phase) for layer in ("0", "1") for phase in ("decode", "prefill")
    }
    assert sum(value for _, phase, value in entries if phase == "decode") == zeros["missing"]
    assert "specexpert_zeros_calls" in zeros["families"]


def test_without_its_flag_the_place_is_not_there(report):
    no_flag = report["no_flag"]
    assert no_flag["decode"] == {} and no_flag["families"] == {}
    assert not no_flag["as_expected"]  # (fetch ran the missing experts: another output)
    assert no_flag["fetched_entries"] == no_flag["missed_entries"] > 0
