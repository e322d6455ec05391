"""Next-layer routing prediction in one launch.

For every token t of layer l's batch (one program per token):

    x_t = s_t * c + sum_k g_{t,k} d_{ids_{t,k}}      (quasi_hidden; router: x_t = s_t)
    y_t = x_t / rms(x_t) * w_{l+1}                   (quasi_hidden; router: y_t = x_t)
    p_t = softmax(W_{l+1} y_t),  top-k of p_t (optionally renormalized)

with ``s`` layer l's router input, ``c = rho_l / w_l`` the calibrated residual scale,
``d`` layer l's default vectors, ``w_{l+1}`` the next layer's RMSNorm weight and
``W_{l+1}`` its gate. The RMS is a per-token scalar, so it is applied to the logits
after the GEMV: one pass over the hidden dimension gathers, sums, squares and
multiplies. Everything accumulates in fp32; unlike the torch path
(:class:`~vllm_specexpert.predict.quasi_hidden.QuasiHiddenPredictor` then the model's
router), ``y`` is not rounded to the model dtype before the GEMV, so an expert at a
near-tie of the k-th logit may be ranked differently. The prediction only decides what
to prefetch (and, under ``speculate``, what runs), so this is the predictor's own
approximation, not the model's output.

Supports softmax scoring with plain top-k (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE,
DeepSeek-V2 ``greedy``); other routing functions use the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def predict_routing_kernel(
    s_ptr,
    stride_s,  # [T, H] layer l's router input
    ids_ptr,
    weights_ptr,
    stride_k,  # [T, K] layer l's experts and gate weights
    vectors_ptr,  # [E_l, H] fp32 default vectors
    scale_ptr,  # [H] fp32 rho_l / w_l
    norm_ptr,  # [H] LN_{l+1} weight
    gate_ptr,
    stride_gate,  # [E, H] layer l+1's gate
    out_ids_ptr,
    out_weights_ptr,  # [T, TOPK] int32, fp32
    H,
    E,
    eps,
    K: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    QUASI_HIDDEN: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    expert_mask = experts < E
    logits = tl.zeros([BLOCK_E], dtype=tl.float32)
    squares = tl.zeros([BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_mask = h < H
        x = tl.load(s_ptr + t * stride_s + h, mask=h_mask, other=0.0).to(tl.float32)
        if QUASI_HIDDEN:
            x = x * tl.load(scale_ptr + h, mask=h_mask, other=0.0)
            for k in tl.static_range(K):
                expert = tl.load(ids_ptr + t * stride_k + k).to(tl.int64)
                g = tl.load(weights_ptr + t * stride_k + k).to(tl.float32)
                x += g * tl.load(vectors_ptr + expert * H + h, mask=h_mask, other=0.0)
            squares += x * x
            x = x * tl.load(norm_ptr + h, mask=h_mask, other=0.0).to(tl.float32)
        gate = tl.load(
            gate_ptr + experts[:, None].to(tl.int64) * stride_gate + h[None, :],
            mask=expert_mask[:, None] & h_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        logits += tl.sum(gate * x[None, :], axis=1)
    if QUASI_HIDDEN:
        logits = logits / tl.sqrt(tl.sum(squares, axis=0) / H + eps)
    logits = tl.where(expert_mask, logits, float("-inf"))

    store_top_k(logits, t, out_ids_ptr, out_weights_ptr, TOPK, TOPK_PAD, BLOCK_E, RENORMALIZE)


@triton.jit
def store_top_k(
    logits,
    t,
    out_ids_ptr,
    out_weights_ptr,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """Softmax over the ``[BLOCK_E]`` logits (entries past E are ``-inf``), top-k,
    optionally renormalized, stored as token ``t``'s row of the outputs."""
    experts = tl.arange(0, BLOCK_E)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)

    slots = tl.arange(0, TOPK_PAD)
    chosen_ids = tl.zeros([TOPK_PAD], dtype=tl.int32)
    chosen_weights = tl.zeros([TOPK_PAD], dtype=tl.float32)
    remaining = tl.where(logits > float("-inf"), probs, -1.0)
    for k in tl.static_range(TOPK):
        best = tl.max(remaining, axis=0)
        # Lowest index among equal probabilities, like a stable sort.
        index = tl.min(tl.where(remaining == best, experts, BLOCK_E), axis=0)
        chosen_ids = tl.where(slots == k, index, chosen_ids)
        chosen_weights = tl.where(slots == k, best, chosen_weights)
        remaining = tl.where(experts == index, -1.0, remaining)
    if RENORMALIZE:
        chosen_weights = chosen_weights / tl.sum(chosen_weights, axis=0)
    out = t * TOPK + slots
    tl.store(out_ids_ptr + out, chosen_ids, mask=slots < TOPK)
    tl.store(out_weights_ptr + out, chosen_weights, mask=slots < TOPK)


GATE_TILE = 2048
"""Elements of the ``[BLOCK_E, BLOCK_H]`` gate tile a program holds in registers: with 4
warps, 16 fp32 values per thread. At 128 experts a 64-wide tile (8192) spilled on sm_90
(255 registers + 168 bytes of stack, ``cuobjdump -res-usage``); 2048 uses 96 registers."""


def block_h(experts: int, hidden: int) -> int:
    """Hidden-dimension block of :func:`predict_routing_kernel` for ``experts`` logits."""
    tile = max(16, GATE_TILE // triton.next_power_of_2(experts))
    return min(tile, triton.next_power_of_2(hidden))


@dataclass
class QuasiHiddenTerms:
    """What ``quasi_hidden`` adds to layer l's router input (module doc)."""

    topk_ids: torch.Tensor
    """``[T, K]`` layer l's experts."""
    topk_weights: torch.Tensor
    """``[T, K]`` their gate weights (same strides as ``topk_ids``)."""
    default_vectors: torch.Tensor
    """``[E_l, H]`` fp32, contiguous: layer l's default vectors."""
    residual_scale: torch.Tensor
    """``[H]`` fp32 ``rho_l / w_l``."""
    norm_weight: torch.Tensor
    """``[H]`` the next layer's RMSNorm weight."""
    eps: float = 1e-6


def predict_routing(
    router_input: torch.Tensor,
    gate_weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    quasi_hidden: QuasiHiddenTerms | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predicted ``(weights fp32 [T, top_k], ids int32 [T, top_k])`` of the next layer:
    ``quasi_hidden`` with its terms, else ``router`` (``router_input`` routed by
    ``gate_weight`` as it is)."""
    tokens, hidden = router_input.shape
    experts = gate_weight.shape[0]
    out_ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_input.device)
    out_weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_input.device)
    if tokens == 0:
        return out_weights, out_ids
    q = quasi_hidden
    if q is not None:
        assert q.default_vectors.dtype == torch.float32 and q.default_vectors.is_contiguous()
        assert q.topk_ids.stride() == q.topk_weights.stride() and q.topk_ids.stride(1) == 1
        k, stride_k, eps = q.topk_ids.shape[1], q.topk_ids.stride(0), q.eps
        terms = (q.topk_ids, q.topk_weights, q.default_vectors, q.residual_scale, q.norm_weight)
    else:
        # Unused pointers (pruned by QUASI_HIDDEN=False); any tensor will do.
        k, stride_k, eps = 0, 0, 0.0
        terms = (router_input,) * 5
    ids, weights, vectors, scale, norm = terms
    assert router_input.stride(1) == 1 and gate_weight.stride(1) == 1
    predict_routing_kernel[(tokens,)](
        router_input,
        router_input.stride(0),
        ids,
        weights,
        stride_k,
        vectors,
        scale,
        norm,
        gate_weight,
        gate_weight.stride(0),
        out_ids,
        out_weights,
        hidden,
        experts,
        eps,
        K=k,
        TOPK=top_k,
        TOPK_PAD=triton.next_power_of_2(top_k),
        BLOCK_E=triton.next_power_of_2(experts),
        BLOCK_H=block_h(experts, hidden),
        QUASI_HIDDEN=q is not None,
        RENORMALIZE=renormalize,
    )
    return out_weights, out_ids
