"""Adding a feature to the engine is one class behind ``EngineFeature`` and one line in
the factory (``vllm_specexpert.features.build``). Shown here with a per-call tracer, as a
new feature's author would write it: the test's wrapped factory stands in for that line.
The engine itself is not touched, and a feature that only watches changes nothing."""

import pytest
import torch
from moe_reference import random_layer, random_routing, reference_moe, slot_kernel

from vllm_specexpert import features
from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.features import DecodeCall, EngineFeature, Resolve
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.phases import PassPhases

NAMES = [f"model.layers.{i}.mlp.experts" for i in range(2)]


class CallTracer(EngineFeature):
    """Records each decode call's hooks in order, with what each hook can see."""

    name = "tracer"
    acts_on_resident_calls = True  # (it must see every call, also a fully resident one)

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.calls = 0

    def begin_call(self, call: DecodeCall) -> None:
        self.events.append(("begin", call.layer.name, call.num_tokens))

    def after_read(self, call: DecodeCall) -> None:
        self.events.append(("read", call.layer.name, call.router_host_ids.tolist()))

    def resolve(self, call: DecodeCall, run: LayerCall, rest: Resolve) -> torch.Tensor:
        out = rest(call, run)
        self.events.append(("resolved", call.layer.name, tuple(out.shape)))
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


@pytest.fixture
def tracers(monkeypatch) -> list[CallTracer]:
    """The factory's one new line: every build (start, reconfigure) appends a tracer."""
    built: list[CallTracer] = []
    build = features.build

    def build_with_tracer(config: SpecExpertConfig, engine) -> list[EngineFeature]:
        built.append(CallTracer())
        return [*build(config, engine), built[-1]]

    monkeypatch.setattr(features, "build", build_with_tracer)
    return built


@pytest.fixture
def make_engine(toy_engines):
    """This file's toy model (two layers of 16 experts, top-4): ``make_engine(budget)`` is
    an engine at ``budget`` and its layers' tensors."""

    def make(budget: float):
        layers = {name: random_layer(seed=i) for i, name in enumerate(NAMES)}
        return toy_engines({"budget": budget}, layers, top_k=4), layers

    return make


def run_steps(engine, layers, steps: int = 3, tokens: int = 2) -> list[torch.Tensor]:
    outs = []
    for step in range(steps):
        for name in layers:
            x, w, ids = random_routing(tokens, 16, 4, seed=step)
            outs.append(engine.run(name, slot_kernel, x, w, ids, PassPhases.decode_only(tokens)))
    return outs


@pytest.mark.parametrize("budget", [0.25, 1.0])
def test_a_tracer_sees_every_decode_call_in_hook_order_and_changes_nothing(
    make_engine, tracers, budget
):
    engine, layers = make_engine(budget)
    tokens = 1 if budget == 1.0 else 2  # one token at 1.0: the resident fast path's case
    outs = run_steps(engine, layers, tokens=tokens)
    tracer = tracers[-1]
    assert engine.feature("tracer") is tracer
    # Exact: what a watching feature leaves is vanilla's output.
    for (step, name), out in zip(((s, n) for s in range(3) for n in layers), outs, strict=True):
        x, w, ids = random_routing(tokens, 16, 4, seed=step)
        assert torch.equal(out, reference_moe(x, w, ids, *layers[name].values()))
    # Each call: begin, the read (the router's ids on the host), resolve, end.
    expected = []
    for step in range(3):
        for name in layers:
            ids = random_routing(tokens, 16, 4, seed=step)[2]
            expected += [
                ("begin", name, tokens),
                ("read", name, ids.tolist()),
                ("resolved", name, (tokens, 32)),
                ("end", name),
            ]
    assert tracer.events == expected
    # Its stats section, its part of the summary, its reset.
    assert engine.stats()["tracer"] == {"calls": 6}
    assert engine.summary().endswith(", traced 6 calls")
    engine.reset_stats()
    assert engine.stats()["tracer"] == {"calls": 0}
    engine.close()


def test_prefill_calls_do_not_reach_decode_hooks(make_engine, tracers):
    engine, _ = make_engine(0.25)
    x, w, ids = random_routing(5, 16, 4, seed=9)
    engine.run(NAMES[0], slot_kernel, x, w, ids, PassPhases.prefill_only(5))
    assert tracers[-1].events == []
    engine.close()


def test_a_reconfigure_builds_the_features_again(make_engine, tracers):
    engine, layers = make_engine(0.25)
    run_steps(engine, layers, steps=1)
    first = engine.feature("tracer")
    engine.reconfigure(SpecExpertConfig.from_dict({"budget": 0.25, "miss_policy": "drop"}))
    assert engine.feature("tracer") is tracers[-1] is not first
    run_steps(engine, layers, steps=1)
    assert engine.stats()["tracer"] == {"calls": 2}
    engine.close()
