"""BuddyMoE's buddy lists and substitution (BuddyMoE, §3).

Offline: from a layer's co-activation matrix M (calibration), expert j's conditional
co-activation with pivot i is ``q_{j|i} = M[i, j] / sum_{j' != i} M[i, j']``; i's buddy
list is the shortest prefix of its peers sorted by q whose cumulative q reaches the
Cumulative Frequency Threshold α, capped at ``K_max`` (and at least one peer when i was
ever co-activated).

Run time, for one layer and batch: the batch distribution gate skips substitution when
the share of requested experts that are not resident is >= β; a token whose Token
Activating Entropy is <= τ keeps its experts; otherwise each missing expert of the token,
in rank order and at most ρ per token, is replaced by its first resident buddy that the
token does not already use (Algorithm 1); the buddy takes the missing expert's weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def buddy_lists(coactivation: np.ndarray, alpha: float, k_max: int) -> np.ndarray:
    """``[E, k_max]`` buddy ids per pivot expert, best first, padded with -1."""
    m = np.asarray(coactivation, dtype=np.float64).copy()
    num_experts = m.shape[0]
    np.fill_diagonal(m, 0.0)
    totals = m.sum(axis=1)
    out = np.full((num_experts, k_max), -1, dtype=np.int64)
    for i in range(num_experts):
        if totals[i] <= 0:
            continue
        q = m[i] / totals[i]
        order = np.argsort(-q, kind="stable")
        order = order[q[order] > 0]
        reached = int(np.searchsorted(np.cumsum(q[order]), alpha - 1e-12)) + 1
        size = min(max(reached, 1), k_max, len(order))
        out[i, :size] = order[:size]
    return out


def token_activating_entropy(topk_weights: torch.Tensor) -> torch.Tensor:
    """BuddyMoE's TAE per token (eq. 1): entropy of the top-k weights renormalised over
    the top-k, divided by log k (0 = one expert takes everything, 1 = uniform)."""
    p = topk_weights.float()
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-20)
    entropy = -(p * p.clamp_min(1e-20).log()).sum(-1)
    return entropy / torch.log(torch.tensor(float(p.shape[-1])))


@dataclass(frozen=True)
class BuddyGates:
    tau: float | np.ndarray
    """Token Activating Entropy gate: substitute only for tokens with TAE > tau (a
    scalar, or one value per token when calibrated per layer)."""
    beta: float
    """Batch distribution gate: no substitution when the share of the batch's requested
    experts that are not resident is >= beta."""
    rho: int
    """Replacement budget: at most this many substitutions per token."""


def substitute(
    topk_ids: np.ndarray,
    resident: np.ndarray,
    buddies: np.ndarray | None,
    tae: np.ndarray,
    gates: BuddyGates,
    rng: np.random.Generator | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 1 with the gates: returns the new ids and a ``[T, K]`` mask of substituted
    entries (those left missing are fetched). ``buddies [E, K_max]``, or ``None`` with
    ``rng`` for the random baseline (any resident expert). Vectorized over tokens, which
    are independent; loops over the K positions only."""
    ids = topk_ids.copy()
    replaced = np.zeros(ids.shape, dtype=bool)
    missing = ~resident[ids]
    if not missing.any():
        return ids, replaced
    requested = np.unique(ids)
    if np.count_nonzero(~resident[requested]) / len(requested) >= gates.beta:
        return ids, replaced
    tau = np.broadcast_to(np.asarray(gates.tau, dtype=np.float64), (ids.shape[0],))
    tokens = np.flatnonzero(missing.any(axis=1) & (tae > tau))
    if not len(tokens):
        return ids, replaced
    used = np.zeros((len(tokens), len(resident)), dtype=bool)
    np.put_along_axis(used, ids[tokens], True, axis=1)
    budget = np.full(len(tokens), gates.rho)
    resident_ids = np.flatnonzero(resident)
    for k in range(ids.shape[1]):
        rows = np.flatnonzero(missing[tokens, k] & (budget > 0))
        if not len(rows):
            continue
        if buddies is None:
            # The random baseline: resident experts in a fresh random order per entry.
            assert rng is not None, "the random baseline (no buddies) needs rng"
            order = np.argsort(rng.random((len(rows), len(resident_ids))), axis=1)
            candidates = resident_ids[order]
        else:
            candidates = buddies[ids[tokens[rows], k]]  # [R, K_max], -1 padded
        valid = candidates >= 0
        safe = np.where(valid, candidates, 0)
        valid &= resident[safe] & ~np.take_along_axis(used[rows], safe, axis=1)
        found = valid.any(axis=1)
        rows, first = rows[found], valid[found].argmax(axis=1)
        chosen = safe[found, first]
        ids[tokens[rows], k] = chosen
        replaced[tokens[rows], k] = True
        used[rows, chosen] = True
        budget[rows] -= 1
    return ids, replaced
