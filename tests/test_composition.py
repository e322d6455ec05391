"""Every pair of features either runs, with its output label, or is refused at start for
a stated reason (:mod:`vllm_specexpert.tools.composition`).

Each pair the engine runs without vLLM runs here on a three-layer toy model (routing
into each next layer, every input a feature needs: predictor inputs and an estimator,
routing statistics, a logit head, in-process peers, a step's demand) for a few decode
steps, and its output is checked against its label: ``exact`` pairs equal the reference
bit for bit, ``equivalent`` ones equal it up to bf16 rounding of partial sums, and the
engine reports the label. The lookahead draft, the token scheduler, ``lowbit``'s INT4
copies and quantized checkpoints are made by vLLM's adapter: their pairs are checked at
start here, and run end to end in their own tests (``test_lookahead``,
``test_token_scheduler``, ``test_lowbit``, ``test_quantized``)."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch
from moe_reference import random_layer, reference_moe, slot_kernel
from test_quality import identity_head
from toy_engine import DemandSource

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.config.sections import MeshConfig
from vllm_specexpert.handoff import StepDemand
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.peers.tier import Sent
from vllm_specexpert.predict import NextLayerRouting, PredictorInputs
from vllm_specexpert.predict.estimator_network import (
    EstimatorShape,
    ExpertEstimator,
    transitions_of,
)
from vllm_specexpert.tiers.host import torch_experts
from vllm_specexpert.tools import composition

E, K, H = composition.MODEL_EXPERTS, composition.MODEL_TOP_K, 32
NAMES = [f"model.layers.{i}.mlp.experts" for i in range(3)]
LAYERS = {name: random_layer(num_experts=E, hidden=H, seed=i) for i, name in enumerate(NAMES)}
MADE_BY_VLLM = {"lookahead", "token_scheduler", "disk"}
"""Dimensions whose pairs run end to end in their own tests (module doc)."""


def made_by_vllm(*chosen) -> bool:
    return any(s.dimension in MADE_BY_VLLM or s.value in ("lowbit", "awq") for s in chosen)


def test_the_documented_table_is_the_tools():
    document = (Path(__file__).parent.parent / "docs" / "composition.md").read_text()
    assert composition.BEGIN in document and composition.END in document
    assert composition.with_table(document) == document, (
        "docs/composition.md is stale: run `specexpert composition`"
    )


@pytest.mark.parametrize("pair", composition.pairs(), ids=lambda p: f"{p[0]}+{p[1]}")
def test_every_pair_runs_with_its_label_or_is_refused_with_a_reason(make_engine, pair):
    verdict = composition.verdict(*pair)
    raw, packed = composition.settings(*pair)
    if not verdict.runs:
        with pytest.raises(SpecExpertConfigError) as error:
            SpecExpertConfig.from_dict(raw).check_fits(E, K, packed)
        assert error.value.field_name == verdict.field and error.value.fix
        return
    config = SpecExpertConfig.from_dict(raw)
    assert config.output == verdict.output
    if made_by_vllm(*pair):
        return  # (run end to end in their own tests)
    check_runs_with_its_label(make_engine, config)


@pytest.mark.parametrize(
    "other",
    [composition.Setting("token_scheduler", "on"), composition.Setting("checkpoint", "awq")],
)
def test_lookahead_runs_exactly_with_the_token_scheduler_and_a_quantized_checkpoint(other):
    # Run end to end, greedy-identical to vanilla vLLM: test_lookahead (the token
    # scheduler holds back requests with drafted tokens) and test_quantized.
    lookahead = composition.Setting("lookahead", "on")
    assert composition.verdict(lookahead, other) == composition.Verdict(True, output="exact")


def test_lookahead_with_a_mesh_is_refused_for_what_the_draft_does_not_the_draft():
    verdict = composition.verdict(
        composition.Setting("lookahead", "on"), composition.Setting("mesh", "sync")
    )
    assert not verdict.runs and verdict.field == "mesh"
    assert "prefetching over the link" in verdict.reason and "no peers" not in verdict.reason


def test_each_feature_alone_runs_or_is_refused(make_engine):
    for feature in composition.features():
        verdict = composition.verdict(feature)
        assert verdict.runs, f"{feature}: {verdict.cell()}"
        if not made_by_vllm(feature):
            check_runs_with_its_label(
                make_engine, SpecExpertConfig.from_dict(composition.settings(feature)[0])
            )


# ----------------------------------------------------------------------- the toy run


def toy_routing(layer: int):
    g = torch.Generator().manual_seed(100 + layer)
    gate, norm = torch.randn(E, H, generator=g), 1 + 0.1 * torch.randn(H, generator=g)

    def rms(h):
        return (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6) * norm).to(
            h.dtype
        )

    def route_logits(h, logits):
        w, ids = torch.softmax(logits.float(), -1).topk(K, -1)
        return w / w.sum(-1, keepdim=True), ids.to(torch.int32)

    def route(h):
        return route_logits(h, h.float() @ gate.T)

    return NextLayerRouting(norm=rms, route=route, route_logits=route_logits)


class InProcessPeers:
    """A peer tier in this process: one peer holding the upper half of every layer's
    experts, computing them with the host's plain-PyTorch kernel."""

    def __init__(self):
        self.mesh, self.peers = MeshConfig(peers=1), [type("Peer", (), {"up": True})()]

    def hosted(self, layer: int) -> np.ndarray:
        return np.arange(E) >= E // 2

    def send(self, layer, x, tokens, experts) -> Sent:
        sent = Sent(tokens, experts, [])
        sent.x, sent.layer = x, layer
        return sent

    def receive(self, sent: Sent):
        ones = torch.ones(len(sent.tokens), 1)
        ids = torch.from_numpy(sent.experts)[:, None]
        y = torch_experts(
            sent.x[torch.from_numpy(sent.tokens)], ones, ids, LAYERS[NAMES[sent.layer]]
        )
        return y.float(), np.ones(len(sent.tokens), dtype=bool)

    def stats(self) -> dict:
        return {"peers": []}

    def reset_stats(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def make_engine(toy_engines):
    """This file's toy model: ``make_engine(config)`` is an engine under ``config`` with
    every input a feature needs wired in (module doc), started."""

    def make(config: SpecExpertConfig):
        engine = toy_engines(
            config,
            {n: {k: v.clone() for k, v in t.items()} for n, t in LAYERS.items()},
            K,
            host_kernel=slot_kernel,
            reports=False,
            start=False,
        )
        g = torch.Generator().manual_seed(3)
        for name, next_name in pairwise(NAMES):
            engine.link_layers(name, next_name)
        engine.provide(next_routing={n: toy_routing(i + 1) for i, n in enumerate(NAMES[:-1])})
        estimator = ExpertEstimator(
            EstimatorShape(H, len(NAMES) - 1, E, K, latent=8), list(range(len(NAMES)))
        ).float()
        engine.provide(
            predictor_inputs=PredictorInputs(
                {n: torch.randn(E, H, generator=g).bfloat16() for n in NAMES},
                {n: torch.ones(H) for n in NAMES},
                estimator,
                transitions_of(estimator, dict(enumerate(NAMES))),
                frozenset(NAMES[:1]),
            )
        )
        coactivation = np.eye(E, dtype=np.int64) * 10 + 1
        engine.provide(
            routing_statistics=dict.fromkeys(NAMES, (coactivation, np.linspace(0, 1, 101)))
        )
        if config.quality is not None:
            engine.provide(logit_head=identity_head(H))
        if config.mesh is not None:
            engine.provide(peer_tier=InProcessPeers())
        engine.start()
        return engine

    return make


def check_runs_with_its_label(make_engine, config: SpecExpertConfig) -> None:
    engine = make_engine(config)
    try:
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(4, H, generator=g).bfloat16()
            routes = {}
            for index in range(len(NAMES)):
                w, ids = toy_routing(index).route(x)
                routes[index] = ids.numpy()
            DemandSource.of(engine).demand = StepDemand(
                tokens=4, layers={i: np.bincount(r.ravel(), minlength=E) for i, r in routes.items()}
            )
            for index, name in enumerate(NAMES):
                w, ids = toy_routing(index).route(x)
                out = engine.run_call(LayerCall(name, slot_kernel, x, w, ids))
                expected = reference_moe(
                    x, w, ids, LAYERS[name]["w13_weight"], LAYERS[name]["w2_weight"]
                )
                assert out.shape == x.shape and torch.isfinite(out.float()).all()
                if config.output == "exact":
                    assert torch.equal(out, expected), f"{name}, step {step}"
                elif config.output == "equivalent":
                    torch.testing.assert_close(
                        out, expected, rtol=0, atol=2 * 2**-8 * float(expected.abs().max())
                    )
                x = (x.float() + out.float()).bfloat16()
        assert engine.stats()["output"] == config.output
    finally:
        engine.close()


# ------------------------------------------------------------ feature order and stages


def run_steps(engine, steps: int = 3) -> list[torch.Tensor]:
    outs = []
    for step in range(steps):
        x = torch.randn(4, H, generator=torch.Generator().manual_seed(step)).bfloat16()
        for index, name in enumerate(NAMES):
            w, ids = toy_routing(index).route(x)
            out = engine.run_call(LayerCall(name, slot_kernel, x, w, ids))
            outs.append(out)
            x = (x.float() + out.float()).bfloat16()
    return outs


@pytest.mark.parametrize("order", ["registry", "reversed"])
def test_mesh_and_prediction_compose_alike_in_either_registry_order(
    make_engine, monkeypatch, order
):
    # no_stop: mesh's early fire uses this layer's prediction (made by prediction's
    # stage) and makes run_prediction, which prediction's next stage uses. With the
    # registry reversed, the stages still run maker before user: the same stages, the
    # same outputs and counters.
    from vllm_specexpert import features

    config = SpecExpertConfig.from_dict(
        {"budget": 0.5, "predictor": "router", "mesh": {"peers": 1, "mode": "no_stop"}}
    )
    reference = make_engine(config)
    expected_outs = run_steps(reference)
    expected_stats = reference.stats()["total"]["decode"]
    expected_route = reference.pipelines[NAMES[1]].describe()["route"]
    if order == "reversed":
        monkeypatch.setattr(features, "REGISTRY", tuple(reversed(features.REGISTRY)))
    engine = make_engine(config)
    route = engine.pipelines[NAMES[1]].describe()["route"]
    assert route.index("prediction.recall") < route.index("mesh.fire")
    assert route.index("mesh.fire") < route.index("prediction.predict")
    assert sorted(route) == sorted(expected_route)
    outs = run_steps(engine)
    assert all(torch.equal(a, b) for a, b in zip(outs, expected_outs, strict=True))
    stats = engine.stats()["total"]["decode"]
    assert stats["fired_entries"] > 0 and stats["speculated_calls"] > 0
    timings = {k for k in stats if k.endswith("_s")}
    assert {k: v for k, v in stats.items() if k not in timings} == {
        k: v for k, v in expected_stats.items() if k not in timings
    }
