"""INT4 experts in vLLM's CPU W4A16 GEMM form (``layers/int4_gemm.py``): the draft on the
disk tier computes them packed. The GEMM on that form gives what ``lowbit``'s codes of
the same weights give dequantized (the same rounding, another layout), with biases and
the layer's activation; where the GEMM cannot run (fp32, sizes not multiples of 32) the
draft's form is ``lowbit``'s, decoded into bf16 slots."""

import pytest
import torch
import torch.nn.functional as F

from vllm_specexpert.layers.int4_copies import Int4DraftForm
from vllm_specexpert.layers.int4_gemm import (
    Int4GemmExperts,
    expert_form,
    gemm_built,
    runs_packed,
)
from vllm_specexpert.layers.packed_experts import low_bit_parameters

EXPERTS, HIDDEN, INTERMEDIATE = 5, 256, 96


def random_experts(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w13_weight": (torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) / 16),
        "w2_weight": (torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) / 16),
        "w13_bias": torch.randn(EXPERTS, 2 * INTERMEDIATE, generator=generator) / 8,
        "w2_bias": torch.randn(EXPERTS, HIDDEN, generator=generator) / 8,
    }


def reference(x, weights, ids, experts, activation) -> torch.Tensor:
    """Fused experts written out, in fp32, on given (dequantized) weights."""
    inter = experts["w2_weight"].shape[-1]
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = x[t].float() @ experts["w13_weight"][e].float().T + experts["w13_bias"][e].float()
            h = activation(h[:inter]) * h[inter:]
            y = h @ experts["w2_weight"][e].float().T + experts["w2_bias"][e].float()
            out[t] += weights[t, k] * y
    return out


NO_GEMM = "this vLLM build has no cpu_gemm_wna16 (its AVX2 build): the draft decodes lowbit's form"


@pytest.mark.skipif(not gemm_built(), reason=NO_GEMM)
def test_the_gemm_form_computes_what_lowbits_codes_give_with_biases_and_the_activation():
    experts = {name: t.bfloat16() for name, t in random_experts(0).items()}
    forms = [
        expert_form({name: t[e] for name, t in experts.items()}, torch.bfloat16)
        for e in range(EXPERTS)
    ]
    packed = {name: torch.stack([f[name] for f in forms]) for name in forms[0]}
    # lowbit's codes of the same weights, dequantized: the same rounding.
    lowbit = low_bit_parameters("layer", EXPERTS, HIDDEN, INTERMEDIATE)
    codes = lowbit.dequantize(lowbit.quantize(experts))
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    ids = torch.tensor([[0, 4], [1, 1], [3, 2], [4, 0], [2, 3], [0, 1], [4, 3]])
    weights = torch.rand(7, 2, generator=torch.Generator().manual_seed(3))
    for name, act in (("silu", F.silu), ("gelu", F.gelu)):
        got = Int4GemmExperts(name)(x, weights, ids, packed).float()
        want = reference(x, weights, ids, codes, act)
        # bf16 rounding of the intermediate only (INT4's own error is in both).
        assert (got - want).norm() < 0.02 * want.norm(), name
        dense = reference(x, weights, ids, experts, act)
        assert (got - want).norm() < (dense - want).norm(), name  # nearer its codes


def test_where_the_gemm_cannot_run_the_draft_keeps_lowbits_form():
    specs = [("w13_weight", (2 * 64, HIDDEN), None), ("w2_weight", (HIDDEN, 64), None)]
    gemm = {name for name, _, _ in Int4DraftForm(torch.bfloat16).specs(specs)}
    packed = {f"{s}_{p}" for s in ("w13", "w2") for p in ("qweight", "scales", "qzeros")}
    # Aligned bf16 or fp16: the GEMM's form wherever this build has the GEMM.
    assert (gemm == packed) == gemm_built()
    assert runs_packed(torch.float16, HIDDEN, 64) == gemm_built()
    # fp32 activations (the GEMM has none), or an intermediate size not a multiple of 32.
    unaligned = [("w13_weight", (2 * 40, HIDDEN), None), ("w2_weight", (HIDDEN, 40), None)]
    for dtype, shapes in ((torch.float32, specs), (torch.bfloat16, unaligned)):
        names = {name for name, _, _ in Int4DraftForm(dtype).specs(shapes)}
        assert "w13_weight_packed" in names and "w13_qweight" not in names, dtype
