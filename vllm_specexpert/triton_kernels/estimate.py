"""The neural expert estimator's routing in one launch (``estimator``, ``hybrid`` on CUDA).

For every token t (one program per token), with the network of
:class:`~vllm_specexpert.predict.estimator_network.ExpertEstimator` at transition j:

    x = A q_t + a + e_j                       (D = latent width)
    z = x + C SiLU(B x + b) + c               (inner width M)
    z = LayerNorm(z) ;  logits = W z + w      (E experts)
    softmax, top-k (optionally renormalized): the model's plain softmax top-k selection

Everything in fp32. ``q_t`` (``quasi_hidden``'s q_l) comes from the torch path, so the
estimator costs this one launch beside it. Tiles stay at :data:`TILE` elements (the
prediction kernel's register budget): ``A`` is read in ``[D, BLOCK_H]`` tiles, ``B`` and
``C`` in ``[BLOCK_M, D]`` / ``[D, BLOCK_M]`` tiles; the head in ``[BLOCK_E, BLOCK_D]``
tiles, which need ``z`` in blocks: it takes one round trip through a ``[T, D]`` scratch
row (``z`` is spread over the program's threads, a block of it is not addressable).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import triton
import triton.language as tl
from torch import nn

from vllm_specexpert.triton_kernels.predict import store_top_k


class EstimatorNetwork(Protocol):
    """The parts of the estimator's network the kernel reads (its ``nn.Module``, of the
    predictor layer above: named here, not imported)."""

    project: nn.Linear
    transition: nn.Embedding
    mlp: nn.Sequential
    norm: nn.LayerNorm
    head: nn.Linear


TILE = 2048
"""Elements of a weight tile a program holds in registers (see ``predict.GATE_TILE``)."""


@triton.jit
def estimate_routing_kernel(
    q_ptr,
    stride_q,  # [T, H] q_l
    proj_w_ptr,
    proj_b_ptr,  # [D, H], [D]
    embedding_ptr,  # [D] the transition's embedding
    up_w_ptr,
    up_b_ptr,  # [M, D], [M]
    down_w_ptr,
    down_b_ptr,  # [D, M], [D]
    norm_w_ptr,
    norm_b_ptr,  # [D], [D]
    head_w_ptr,
    head_b_ptr,  # [E, D], [E]
    scratch_ptr,  # [T, D] fp32
    out_ids_ptr,
    out_weights_ptr,  # [T, TOPK] int32, fp32
    H,
    M,
    E,
    eps,
    D: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    x = tl.zeros([D], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_mask = h < H
        q = tl.load(q_ptr + t * stride_q + h, mask=h_mask, other=0.0).to(tl.float32)
        a = tl.load(proj_w_ptr + d[:, None] * H + h[None, :], mask=h_mask[None, :], other=0.0)
        x += tl.sum(a * q[None, :], axis=1)
    x += tl.load(proj_b_ptr + d) + tl.load(embedding_ptr + d)

    z = x + tl.load(down_b_ptr + d)
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_mask = m < M
        b = tl.load(up_w_ptr + m[:, None] * D + d[None, :], mask=m_mask[:, None], other=0.0)
        u = tl.sum(b * x[None, :], axis=1) + tl.load(up_b_ptr + m, mask=m_mask, other=0.0)
        u = tl.where(m_mask, u / (1.0 + tl.exp(-u)), 0.0)  # SiLU
        c = tl.load(down_w_ptr + d[:, None] * M + m[None, :], mask=m_mask[None, :], other=0.0)
        z += tl.sum(c * u[None, :], axis=1)

    mean = tl.sum(z, axis=0) / D
    centered = z - mean
    variance = tl.sum(centered * centered, axis=0) / D
    z = centered / tl.sqrt(variance + eps) * tl.load(norm_w_ptr + d) + tl.load(norm_b_ptr + d)
    tl.store(scratch_ptr + t * D + d, z)
    tl.debug_barrier()  # every thread's part of z is written before blocks are read

    experts = tl.arange(0, BLOCK_E)
    expert_mask = experts < E
    logits = tl.load(head_b_ptr + experts, mask=expert_mask, other=0.0)
    for d0 in range(0, D, BLOCK_D):
        block = d0 + tl.arange(0, BLOCK_D)
        zb = tl.load(scratch_ptr + t * D + block)
        w = tl.load(
            head_w_ptr + experts[:, None].to(tl.int64) * D + block[None, :],
            mask=expert_mask[:, None],
            other=0.0,
        )
        logits += tl.sum(w * zb[None, :], axis=1)
    logits = tl.where(expert_mask, logits, float("-inf"))
    store_top_k(logits, t, out_ids_ptr, out_weights_ptr, TOPK, TOPK_PAD, BLOCK_E, RENORMALIZE)


def blocks(latent: int, inner: int, hidden: int, experts: int) -> dict[str, int]:
    """The tile widths of :func:`estimate_routing_kernel` for a network's shape."""
    return {
        "BLOCK_H": min(max(16, TILE // latent), triton.next_power_of_2(hidden)),
        "BLOCK_M": min(max(16, TILE // latent), triton.next_power_of_2(inner)),
        "BLOCK_D": min(max(16, TILE // triton.next_power_of_2(experts)), latent),
    }


def estimate_routing(
    q: torch.Tensor, network: EstimatorNetwork, transition: int, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predicted ``(weights fp32 [T, top_k], ids int32 [T, top_k])`` of the next layer
    from ``q [T, H]`` by ``network`` (an ``ExpertEstimator`` in fp32) at
    ``transition``."""
    tokens, hidden = q.shape
    # The MLP's two linear layers (``Sequential`` indexes as a plain ``Module``).
    up, down = cast(nn.Linear, network.mlp[0]), cast(nn.Linear, network.mlp[2])
    latent, inner = network.project.weight.shape[0], up.weight.shape[0]
    experts = network.head.weight.shape[0]
    assert latent == triton.next_power_of_2(latent), "latent width must be a power of 2"
    assert q.stride(1) == 1
    out_ids = torch.empty(tokens, top_k, dtype=torch.int32, device=q.device)
    out_weights = torch.empty(tokens, top_k, dtype=torch.float32, device=q.device)
    if tokens == 0:
        return out_weights, out_ids
    scratch = torch.empty(tokens, latent, dtype=torch.float32, device=q.device)
    estimate_routing_kernel[(tokens,)](
        q,
        q.stride(0),
        network.project.weight,
        network.project.bias,
        network.transition.weight[transition],
        up.weight,
        up.bias,
        down.weight,
        down.bias,
        network.norm.weight,
        network.norm.bias,
        network.head.weight,
        network.head.bias,
        scratch,
        out_ids,
        out_weights,
        hidden,
        inner,
        experts,
        network.norm.eps,
        D=latent,
        TOPK=top_k,
        TOPK_PAD=triton.next_power_of_2(top_k),
        BLOCK_E=triton.next_power_of_2(experts),
        RENORMALIZE=renormalize,
        **blocks(latent, inner, hidden, experts),
    )
    return out_weights, out_ids
