"""Every Triton kernel of ``vllm_specexpert.triton_kernels`` against its torch reference,
on CPU tensors under Triton's interpreter (see conftest)."""

import math

import pytest
import torch

from vllm_specexpert.quant_formats import (
    AwqFormat,
    Fp8Format,
    GptqFormat,
    PackQuantizedFormat,
)
from vllm_specexpert.triton_kernels.dequantize import dequantize_packed
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
        chosen = q.default_vectors.float()[q.topk_ids.long()]  # [T, K, H]
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
    return {
        "router_input": torch.randn(tokens, hidden, generator=g).to(dtype),
        "gate_weight": (torch.randn(experts, hidden, generator=g) / hidden**0.5).to(dtype),
        "topk_ids": torch.stack(
            [torch.randperm(experts_l, generator=g)[:k] for _ in range(tokens)]
        ).int(),
        "topk_weights": torch.rand(tokens, k, generator=g),
        "default_vectors": torch.randn(experts_l, hidden, generator=g),
        "residual_scale": torch.rand(hidden, generator=g) + 0.5,
        "norm_weight": (torch.rand(hidden, generator=g) + 0.5).to(dtype),
        "eps": 1e-6,
    }


def _call(function, inputs, top_k, renormalize):
    """``function`` (kernel or reference) on an ``_inputs`` dict: ``quasi_hidden`` when it
    has the default vectors, else ``router``."""
    terms = None
    if "default_vectors" in inputs:
        terms = QuasiHiddenTerms(
            **{
                key: value
                for key, value in inputs.items()
                if key not in ("router_input", "gate_weight")
            }
        )
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
    widened = {
        key: value.float() if torch.is_tensor(value) and value.dtype == torch.bfloat16 else value
        for key, value in inputs.items()
    }
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
    slot_map = torch.arange(40, dtype=torch.int32) % 7 - 1  # arbitrary prior state
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
    w13 = torch.randn(12, 6, 10, generator=g).to(dtype)  # 60 per row
    w2 = torch.randn(12, 10, 3, generator=g).to(dtype)  # 30 per row
    slots13 = torch.zeros(4, 6, 10, dtype=dtype)
    slots2 = torch.zeros(4, 10, 3, dtype=dtype)
    experts = torch.tensor([11, 0, 7], dtype=torch.int32)
    slots = torch.tensor([2, 3, 0], dtype=torch.int32)
    # A block smaller than a row and not dividing it: masks and block offsets matter.
    copy_experts((w13, w2), (slots13, slots2), experts, slots, block=16)
    for expert, slot in zip(experts.tolist(), slots.tolist(), strict=True):
        assert torch.equal(slots13[slot], w13[expert])
        assert torch.equal(slots2[slot], w2[expert])
    assert not slots13[1].any() and not slots2[1].any()  # untouched slot


# --------------------------------------------------------------------- dequantize

# (format, out, in, batch dims): in and out not powers of two where the format allows it
# (multiples of 8, and of the group size), one group per row (-1), FP8 blocks that do
# not divide the weight, a block larger than it, and [experts, projections] batches.
DEQUANTIZE_CASES = [
    (AwqFormat("awq", group_size=32), 96, 160, ()),
    (AwqFormat("awq", group_size=-1), 40, 72, (3, 2)),
    (GptqFormat("gptq", group_size=32, symmetric=True), 96, 160, ()),
    (GptqFormat("gptq", group_size=32, symmetric=False), 96, 160, (3, 2)),
    (GptqFormat("gptq", group_size=-1, symmetric=False), 24, 72, ()),
    (PackQuantizedFormat("pack-quantized", group_size=32, symmetric=True), 96, 160, (3, 2)),
    (PackQuantizedFormat("pack-quantized", group_size=32, symmetric=False), 96, 160, ()),
    (PackQuantizedFormat("pack-quantized", group_size=-1, symmetric=False), 40, 72, (3, 2)),
    (PackQuantizedFormat("pack-quantized", group_size=-1, symmetric=True), 24, 72, ()),
    (Fp8Format("fp8", scales="tensor"), 100, 150, (3, 2)),
    (Fp8Format("fp8", scales="channel"), 100, 150, ()),
    (Fp8Format("fp8", scales="block", block=(48, 48)), 100, 150, (3, 2)),
    (Fp8Format("fp8", scales="block", block=(128, 128)), 40, 72, ()),
]


def _case_id(case):
    fmt, out_features, in_features, batch = case
    detail = getattr(fmt, "scales", None) or (
        f"g{fmt.group_size}"
        + ("" if isinstance(fmt, AwqFormat) else "-sym" if fmt.symmetric else "-asym")
    )
    if getattr(fmt, "scales", None) == "block":
        detail += f"{fmt.block[0]}x{fmt.block[1]}"
    return f"{fmt.name}-{detail}-{out_features}x{in_features}-b{'x'.join(map(str, batch)) or 1}"


def _quantized(fmt, out_features, in_features, batch, seed=0):
    """``fmt.quantize`` of random ``[out, in]`` weights, stacked into ``batch``."""
    g = torch.Generator().manual_seed(seed)
    weights = [
        torch.randn(out_features, in_features, generator=g) * 0.05 for _ in range(math.prod(batch))
    ]
    packed = [fmt.quantize(w) for w in weights]
    return {
        key: torch.stack([p[key] for p in packed]).reshape(*batch, *packed[0][key].shape)
        for key in packed[0]
    }


def _bits(weight):
    """bf16 bits: ``torch.equal`` on the values would take -0.0 for 0.0."""
    return weight.view(torch.int16)


def _check_dequantize(fmt, tensors, out_features, in_features):
    expected = fmt.dequantize(tensors, out_features, in_features)
    got = dequantize_packed(fmt, tensors, out_features, in_features)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    assert torch.equal(_bits(got), _bits(expected)), (got.float() - expected.float()).abs().max()
    return got


@pytest.mark.parametrize("case", DEQUANTIZE_CASES, ids=_case_id)
def test_dequantize_matches_the_format_bit_for_bit(case):
    fmt, out_features, in_features, batch = case
    tensors = _quantized(fmt, out_features, in_features, batch)
    got = _check_dequantize(fmt, tensors, out_features, in_features)
    assert got.is_contiguous() and got.abs().max() > 0


@pytest.mark.parametrize("case", DEQUANTIZE_CASES[1::2], ids=_case_id)
def test_dequantize_reads_strides_not_layouts(case):
    """Every tensor stored with its last two dimensions swapped (a view, as a transposed
    checkpoint tensor would be): the kernel must follow the strides it is given."""
    fmt, out_features, in_features, batch = case
    tensors = {
        key: value.mT.contiguous().mT if value.dim() >= 2 else value
        for key, value in _quantized(fmt, out_features, in_features, batch, 1).items()
    }
    assert any(not value.is_contiguous() for value in tensors.values())
    _check_dequantize(fmt, tensors, out_features, in_features)


@pytest.mark.parametrize(
    "fmt",
    [
        AwqFormat("awq", group_size=32),
        GptqFormat("gptq", group_size=32, symmetric=False),
        PackQuantizedFormat("pack-quantized", group_size=32, symmetric=False),
        PackQuantizedFormat("pack-quantized", group_size=-1, symmetric=True),
    ],
    ids=lambda f: f"{f.name}-g{f.group_size}",
)
def test_dequantize_of_arbitrary_words(fmt):
    """Random 32-bit words, not just what ``quantize`` writes: every nibble value in every
    position, the sign bit set (an arithmetic shift), GPTQ's stored zero 15 (zero 16),
    and scales of either sign anywhere in their dtype's range (q = z with s < 0: -0.0)."""
    out_features, in_features, batch = 64, 96, (2,)
    g = torch.Generator().manual_seed(2)
    tensors = {}
    for name, (shape, dtype) in fmt.tensor_shapes(out_features, in_features).items():
        shape = (*batch, *shape)
        if dtype == torch.int32:
            words = torch.randint(-(2**31), 2**31, shape, generator=g, dtype=torch.int64)
            tensors[name] = words.int()
        elif dtype.is_floating_point:
            tensors[name] = (
                torch.randn(shape, generator=g) * 10.0 ** torch.randint(-4, 3, shape, generator=g)
            ).to(dtype)
    assert (tensors[next(iter(tensors))] < 0).any()
    _check_dequantize(fmt, tensors, out_features, in_features)


def test_dequantize_fp8_every_code_and_rounding_ties():
    """All 256 e4m3 bytes (subnormals, both zeros, +-448, NaN) times scales with few
    significant bits, so that some products lie exactly halfway between two bf16 values
    (round to even, not truncation nor away from zero)."""
    fmt = Fp8Format("fp8", scales="channel")
    weight = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(1, 256)
    scales = torch.tensor([1.0, 1 + 2**-4 + 2**-8, 3 * 2**-8 + 1, 2**-3 + 2**-9, 1e-3])
    tensors = {
        "weight": weight.expand(len(scales), 256).contiguous(),
        "weight_scale": scales.reshape(-1, 1),
    }
    products = tensors["weight"].float() * tensors["weight_scale"]
    low = products.view(torch.int32) & 0xFFFF
    assert (low == 0x8000).sum() > 10  # ties present
    expected = fmt.dequantize(tensors, len(scales), 256)
    got = dequantize_packed(fmt, tensors, len(scales), 256)
    nan = products.isnan()
    assert nan.sum() == 2 * len(scales) and torch.equal(got.isnan(), nan)
    assert torch.equal(_bits(got)[~nan], _bits(expected)[~nan])


def test_dequantize_int4_rounding_ties():
    """INT4: ``(q - z) * s`` exactly halfway between two bf16 values rounds to the even
    one (1 + 2^-8 down, 1 + 3 * 2^-8 up, negatives alike); just above halfway rounds up."""
    fmt = GptqFormat("gptq", group_size=-1)
    scales = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-10, -(1 + 3 * 2**-8)] * 2
    rounded = [1.0, 1 + 2**-6, 1 + 2**-7, -(1 + 2**-6)] * 2
    tensors = {
        "qweight": torch.full((2, 8), 0x22222222, dtype=torch.int32),  # q = 2
        "qzeros": torch.zeros(1, 1, dtype=torch.int32),  # z = 0 + 1
        "scales": torch.tensor([scales], dtype=torch.float16),
    }
    got = _check_dequantize(fmt, tensors, 8, 16)
    assert torch.equal(got, torch.tensor(rounded, dtype=torch.bfloat16)[:, None].expand(8, 16))
