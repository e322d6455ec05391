"""The predictors' one-launch path (``NextLayerRouting.fused``, used on CUDA) predicts
what their torch path predicts, here on fp32 CPU tensors under the interpreter."""

import pytest
import torch

from vllm_specexpert.predict import (
    FusedRouting,
    LayerState,
    NextLayerRouting,
    QuasiHiddenPredictor,
    RouterPredictor,
    residual_scale,
)

TOKENS, HIDDEN, EXPERTS, TOP_K = 7, 80, 24, 4


def _next_layer(generator, renormalize):
    gate = torch.randn(EXPERTS, HIDDEN, generator=generator) / HIDDEN**0.5
    norm_weight = torch.rand(HIDDEN, generator=generator) + 0.5
    eps = 1e-6

    def norm(x):
        return torch.nn.functional.rms_norm(x.float(), (HIDDEN,), norm_weight, eps).to(x.dtype)

    def route(x):
        probs = torch.softmax(x.float() @ gate.t(), dim=-1)
        weights, ids = torch.topk(probs, TOP_K, dim=-1)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, ids.int()

    fused = FusedRouting(
        gate_weight=gate, norm_weight=norm_weight, eps=eps, top_k=TOP_K, renormalize=renormalize
    )
    return NextLayerRouting(norm=norm, route=route), fused


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("name", ["router", "quasi_hidden"])
def test_fused_prediction_equals_the_torch_path(name, renormalize):
    g = torch.Generator().manual_seed(3)
    state = LayerState(
        router_input=torch.randn(TOKENS, HIDDEN, generator=g),
        topk_ids=torch.stack(
            [torch.randperm(16, generator=g)[:TOP_K] for _ in range(TOKENS)]
        ).int(),
        topk_weights=torch.softmax(torch.randn(TOKENS, TOP_K, generator=g), -1),
    )
    if name == "router":
        predictor = RouterPredictor()
    else:
        this_norm = torch.rand(HIDDEN, generator=g) + 0.5
        predictor = QuasiHiddenPredictor(
            {"l": torch.randn(16, HIDDEN, generator=g)}, {"l": residual_scale(this_norm, 3.0)}
        )
    torch_path, fused = _next_layer(g, renormalize)
    expected = predictor.predict(state, "l", torch_path)
    got = predictor.predict(state, "l", NextLayerRouting(torch_path.norm, torch_path.route, fused))
    assert torch.equal(got.topk_ids, expected.topk_ids)
    torch.testing.assert_close(got.topk_weights, expected.topk_weights, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_estimator_equals_the_torch_path(renormalize):
    """The estimator's one launch (network, softmax, top-k) against the network in torch
    and the torch selection, on q_l of quasi_hidden."""
    from vllm_specexpert.predict import EstimatorPredictor, PredictorInputs
    from vllm_specexpert.predict.estimator_network import EstimatorShape, ExpertEstimator

    g = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    state = LayerState(
        router_input=torch.randn(TOKENS, HIDDEN, generator=g),
        topk_ids=torch.stack(
            [torch.randperm(16, generator=g)[:TOP_K] for _ in range(TOKENS)]
        ).int(),
        topk_weights=torch.softmax(torch.randn(TOKENS, TOP_K, generator=g), -1),
    )
    network = ExpertEstimator(
        EstimatorShape(
            hidden_size=HIDDEN, num_transitions=3, num_experts=EXPERTS, top_k=TOP_K, latent=32
        )
    )
    for p in network.parameters():  # trained-looking values, not the init's zeros
        p.data = torch.randn(p.shape, generator=g) * 0.3
    this_norm = torch.rand(HIDDEN, generator=g) + 0.5
    predictor = EstimatorPredictor(
        PredictorInputs(
            {"l": torch.randn(16, HIDDEN, generator=g)},
            {"l": residual_scale(this_norm, 3.0)},
            network.eval(),
        ),
        {"l": 2},
    )
    torch_path, fused = _next_layer(g, renormalize)

    def route_logits(x, logits):
        weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), TOP_K, dim=-1)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, ids.int()

    routing = NextLayerRouting(torch_path.norm, torch_path.route, route_logits=route_logits)
    expected = predictor.predict(state, "l", routing)
    routing.fused = fused
    got = predictor.predict(state, "l", routing)
    assert got.by_estimator and expected.by_estimator
    assert torch.equal(got.topk_ids, expected.topk_ids)
    torch.testing.assert_close(got.topk_weights, expected.topk_weights, rtol=2e-5, atol=1e-6)
    # Another transition's embedding predicts other experts: the kernel reads row j.
    predictor.estimator_layers["l"] = 0
    assert not torch.equal(predictor.predict(state, "l", routing).topk_ids, got.topk_ids)
