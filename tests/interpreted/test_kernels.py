"""Every Triton kernel of ``vllm_specexpert.triton_kernels`` against its torch reference,
on CPU tensors under Triton's interpreter (see conftest)."""

import pytest
import torch

from vllm_specexpert.triton_kernels.predict import QuasiHiddenTerms, predict_routing
from vllm_specexpert.triton_kernels.slots import copy_experts, update_slot_map

# (tokens, hidden, next-layer experts, this layer's experts, K, top-k): hidden not a
# multiple of the kernel's block, expert counts not powers of two, top-k not either.
SHAPES = [(5, 100, 24, 16, 3, 4), (3, 64, 8, 8, 2, 2), (2, 96, 64, 40, 4, 6)]
# Interpreted fp32 arithmetic in another order than torch's: ~1e-6 relative.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-5, torch.bfloat16: 2e-5}


def predict_routing_reference(
    router_input: torch.Tensor,
    gate_weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    quasi_hidden: QuasiHiddenTerms | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same computation in torch, fp32 throughout: ``(weights, ids, probs)``, with
    ``probs [T, E]`` the full softmax (for tie-aware comparisons)."""
    x = router_input.float()
    q = quasi_hidden
    if q is not None:
        chosen = q.default_vectors.float()[q.topk_ids.long()]                # [T, K, H]
        x = x * q.residual_scale.float() + (q.topk_weights.float().unsqueeze(-1) * chosen).sum(1)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + q.eps) * q.norm_weight.float()
    probs = torch.softmax(x @ gate_weight.float().t(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32), probs


def _inputs(shape, dtype, seed=0):
    tokens, hidden, experts, experts_l, k, _ = shape
    g = torch.Generator().manual_seed(seed)
    return dict(
        router_input=torch.randn(tokens, hidden, generator=g).to(dtype),
        gate_weight=(torch.randn(experts, hidden, generator=g) / hidden ** 0.5).to(dtype),
        topk_ids=torch.stack([torch.randperm(experts_l, generator=g)[:k]
                              for _ in range(tokens)]).int(),
        topk_weights=torch.rand(tokens, k, generator=g),
        default_vectors=torch.randn(experts_l, hidden, generator=g),
        residual_scale=torch.rand(hidden, generator=g) + 0.5,
        norm_weight=(torch.rand(hidden, generator=g) + 0.5).to(dtype),
        eps=1e-6,
    )


def _call(function, inputs, top_k, renormalize):
    """``function`` (kernel or reference) on an ``_inputs`` dict: ``quasi_hidden`` when it
    has the default vectors, else ``router``."""
    terms = None
    if "default_vectors" in inputs:
        terms = QuasiHiddenTerms(**{key: value for key, value in inputs.items()
                                    if key not in ("router_input", "gate_weight")})
    return function(inputs["router_input"], inputs["gate_weight"], top_k, renormalize, terms)


def _check_against_reference(inputs, top_k, renormalize, dtype):
    weights, ids = _call(predict_routing, inputs, top_k, renormalize)
    ref_weights, ref_ids, probs = _call(predict_routing_reference, inputs, top_k, renormalize)
    # The data have no near-ties at the k-th expert, so ids must agree exactly.
    ordered = probs.sort(-1, descending=True).values
    assert (ordered[:, top_k - 1] - ordered[:, top_k]).min() > 1e-4
    assert ids.dtype == torch.int32 and torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights.float(), rtol=TOLERANCE[dtype], atol=1e-6)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(len(weights)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_quasi_hidden_prediction_matches_reference(shape, dtype, renormalize):
    _check_against_reference(_inputs(shape, dtype), shape[-1], renormalize, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_router_prediction_matches_reference(shape, dtype):
    inputs = _inputs(shape, dtype)
    inputs = {key: inputs[key] for key in ("router_input", "gate_weight")}
    _check_against_reference(inputs, shape[-1], True, dtype)


def test_bf16_semantics_by_casting():
    """bf16 model tensors: the kernel widens them to fp32 on load. The interpreter's bf16
    support is unreliable (triton issue 11584 for tl.dot), so bf16 is checked by casting:
    bf16-rounded values given as fp32 must predict what the reference predicts from the
    bf16 tensors themselves."""
    inputs = _inputs(SHAPES[0], torch.bfloat16)
    widened = {key: value.float() if torch.is_tensor(value) and value.dtype == torch.bfloat16
               else value for key, value in inputs.items()}
    weights, ids = _call(predict_routing, widened, 4, True)
    ref_weights, ref_ids, _ = _call(predict_routing_reference, inputs, 4, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=2e-5, atol=1e-6)


def test_prediction_uses_every_input():
    """Each term of the quasi-hidden state moves the prediction (a kernel that dropped the
    residual scale, the default vectors, their weights or the norm weight would pass a
    comparison on inputs where that term is neutral)."""
    shape = (6, 64, 32, 16, 4, 4)
    base = _inputs(shape, torch.float32, seed=1)
    reference = _call(predict_routing, base, 4, False)[0]
    for key in ("residual_scale", "default_vectors", "topk_weights", "norm_weight"):
        changed = dict(base)
        changed[key] = base[key] * torch.linspace(0.2, 3.0, base[key].shape[-1])
        weights = _call(predict_routing, changed, 4, False)[0]
        assert not torch.allclose(weights, reference, atol=1e-3), key


def test_no_tokens():
    inputs = _inputs(SHAPES[0], torch.float32)
    inputs["router_input"] = inputs["router_input"][:0]
    weights, ids = _call(predict_routing, inputs, 4, True)
    assert weights.shape == ids.shape == (0, 4)


def test_slot_map_update_writes_admissions_and_evictions_only():
    slot_map = torch.arange(40, dtype=torch.int32) % 7 - 1          # arbitrary prior state
    before = slot_map.clone()
    experts = torch.tensor([3, 39, 0, 17], dtype=torch.int32)
    slots = torch.tensor([5, -1, 2, -1], dtype=torch.int32)
    update_slot_map(slot_map, experts, slots)
    expected = before.clone()
    expected[experts.long()] = slots
    assert torch.equal(slot_map, expected)
    assert not torch.equal(expected, before)


def test_slot_map_update_of_more_entries_than_one_block():
    slot_map = torch.full((3000,), -1, dtype=torch.int32)
    experts = torch.randperm(3000, generator=torch.Generator().manual_seed(0))[:2500].int()
    update_slot_map(slot_map, experts, torch.arange(2500, dtype=torch.int32))
    assert torch.equal(slot_map[experts.long()], torch.arange(2500, dtype=torch.int32))
    assert int((slot_map == -1).sum()) == 500


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_copy_experts_moves_whole_rows_of_both_tensors(dtype):
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(12, 6, 10, generator=g).to(dtype)        # 60 per row
    w2 = torch.randn(12, 10, 3, generator=g).to(dtype)         # 30 per row
    slots13 = torch.zeros(4, 6, 10, dtype=dtype)
    slots2 = torch.zeros(4, 10, 3, dtype=dtype)
    experts = torch.tensor([11, 0, 7], dtype=torch.int32)
    slots = torch.tensor([2, 3, 0], dtype=torch.int32)
    # A block smaller than a row and not dividing it: masks and block offsets matter.
    copy_experts((w13, w2), (slots13, slots2), experts, slots, block=16)
    for expert, slot in zip(experts.tolist(), slots.tolist()):
        assert torch.equal(slots13[slot], w13[expert])
        assert torch.equal(slots2[slot], w2[expert])
    assert not slots13[1].any() and not slots2[1].any()             # untouched slot
