"""Adding a feature to the engine costs one new module under ``features/``, one line in
the registry and one word in the package's map; the engine is not touched.

Shown on a copy of the package: the test writes a per-call tracer as its author would,
adds the two lines, then runs, in a fresh interpreter on the copy, the layout checks and
a toy engine with the tracer turned on by the config. A feature that only watches
changes nothing."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_specexpert

TESTS = Path(__file__).parent
PACKAGE = Path(vllm_specexpert.__file__).parent

FEATURE_MODULE = '''"""Records each decode call's hooks in order, with what each hook sees
(always on: a feature with its own setting would read it from ``parts.config``)."""

from __future__ import annotations

import torch

from vllm_specexpert.features.base import (
    DecodeCall,
    EngineFeature,
    EngineParts,
    Inputs,
    Resolve,
)
from vllm_specexpert.layer_call import LayerCall


class CallTracer(EngineFeature):
    name = "tracer"
    acts_on_resident_calls = True  # (it must see every call, also a fully resident one)

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.calls = 0

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        return cls()

    def begin_call(self, call: DecodeCall) -> None:
        self.events.append(("begin", call.layer.name, call.num_tokens))

    def after_read(self, call: DecodeCall) -> None:
        self.events.append(("read", call.layer.name, call.router_host_ids.tolist()))

    def resolve(self, call: DecodeCall, run: LayerCall, rest: Resolve) -> torch.Tensor:
        out = rest(call, run)
        self.events.append(("resolved", call.layer.name, list(out.shape)))
        return out

    def end_call(self, call: DecodeCall) -> None:
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

# Runs in the fresh interpreter, on the copy; prints what the parent asserts.
SCRIPT = """
import json, sys
import torch
import vllm_specexpert
from moe_reference import random_layer, random_routing, reference_moe, slot_kernel
from toy_engine import build_engine
from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.features.call_tracer import CallTracer
from vllm_specexpert.layer_call import LayerRequest
from vllm_specexpert.phases import PassPhases

NAMES = [f"model.layers.{i}.mlp.experts" for i in range(2)]
LAYERS = {name: random_layer(seed=i) for i, name in enumerate(NAMES)}
report = {"package": vllm_specexpert.__file__}


def run(engine, tokens, steps=3, phases=PassPhases.decode_only):
    exact = True
    for step in range(steps):
        for name in NAMES:
            x, w, ids = random_routing(tokens, 16, 4, seed=step)
            out = engine.run_call(LayerRequest(name, slot_kernel, x, w, ids, phases(tokens)))
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
engine.reconfigure(SpecExpertConfig.from_dict({"budget": 0.25, "miss_policy": "drop"}))
report["rebuilt"] = engine.feature(CallTracer) is not first
run(engine, 2, steps=1)
report["after_reconfigure"] = engine.stats()["tracer"]
engine.close()
print("REPORT " + json.dumps(report))
"""


def _add_feature(package: Path) -> None:
    """The whole cost of a feature: its module, its registry line, its word in the map."""
    (package / "features" / "call_tracer.py").write_text(FEATURE_MODULE)
    registry = package / "features" / "__init__.py"
    text = registry.read_text()
    assert text.count('    "low_bit",\n') == 1
    registry.write_text(text.replace('    "low_bit",\n', '    "low_bit",\n    "call_tracer",\n'))
    init = package / "__init__.py"
    text = init.read_text()
    assert text.count("(INT4 copies' slots)") == 1
    init.write_text(text.replace("(INT4 copies' slots)", "(INT4 copies' slots), call_tracer"))


def _in_copy(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(TESTS)])}
    return subprocess.run(
        [sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def copy_with_feature(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("copy")
    shutil.copytree(PACKAGE, root / "vllm_specexpert", ignore=shutil.ignore_patterns("__pycache__"))
    _add_feature(root / "vllm_specexpert")
    return root


@pytest.fixture(scope="module")
def report(copy_with_feature) -> dict:
    done = _in_copy(copy_with_feature, "-c", SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT "))


def test_the_copy_with_the_feature_keeps_the_layout(copy_with_feature):
    done = _in_copy(
        copy_with_feature,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(TESTS / "test_layout.py"),
    )
    assert done.returncode == 0, done.stdout[-3000:]


def test_the_layout_check_sees_a_feature_left_out_of_the_map(tmp_path):
    """The fault: the module and its registry line, without its word in the map."""
    shutil.copytree(
        PACKAGE, tmp_path / "vllm_specexpert", ignore=shutil.ignore_patterns("__pycache__")
    )
    (tmp_path / "vllm_specexpert" / "features" / "call_tracer.py").write_text(FEATURE_MODULE)
    done = _in_copy(
        tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "test_layout.py")
    )
    assert done.returncode != 0 and "call_tracer" in done.stdout


@pytest.mark.parametrize("budget", ["0.25", "1.0"])
def test_the_tracer_sees_every_decode_call_in_hook_order_and_changes_nothing(report, budget):
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
                ["begin", name, tokens],
                ["read", name, ids.tolist()],
                ["resolved", name, [tokens, 32]],
                ["end", name],
            ]
    assert seen["events"] == expected
    assert seen["stats"] == {"calls": 6}
    assert seen["summary_end"] == ", traced 6 calls"
    assert seen["after_reset"] == {"calls": 0}


def test_prefill_calls_do_not_reach_decode_hooks(report):
    assert report["prefill_events"] == []


def test_a_reconfigure_builds_the_feature_again(report):
    assert report["rebuilt"]
    assert report["after_reconfigure"] == {"calls": 2}
