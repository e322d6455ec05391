"""Expert compute on the host, from the slow tier (``cpu`` and ``auto`` miss policies).

The llama.cpp/KTransformers answer to a miss: compute the missing expert where its
weights are while the device computes the resident ones, and add the outputs. CPU build:
vLLM's CPU fused-experts kernel on the store's tensors, charged with ``host_slowdown``
under an emulated link; CUDA: :func:`torch_experts` on the pinned store, NOT RUN ON A GPU
YET (docs/design.md, "Miss policies"). :class:`HostCostModel` predicts the duration for
``auto``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vllm_specexpert.tiers.link import sleep_until
from vllm_specexpert.tiers.store import LayerExperts

HostKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor
]
"""``kernel(x, topk_weights, expert_ids, tensors) -> out`` on host tensors, where
``tensors`` are the layer's whole ``[E, ...]`` store tensors."""

GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}
"""Activations :func:`torch_experts` implements (``act(gate) * up``, w13 = [gate; up])."""


def torch_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_ids: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    activation: str = "silu",
) -> torch.Tensor:
    """Plain-PyTorch fused experts, one GEMM pair per distinct expert; fp32 accumulation
    over the top-k. The host kernel where vLLM has no host MoE kernel (CUDA builds)."""
    act = GATED_ACTIVATIONS[activation]
    w13, w2 = tensors["w13_weight"], tensors["w2_weight"]
    inter = w2.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(expert_ids).tolist():
        rows, ks = (expert_ids == expert).nonzero(as_tuple=True)
        h = x[rows] @ w13[expert].T
        y = (act(h[:, :inter]) * h[:, inter:]) @ w2[expert].T
        out.index_add_(0, rows, y.float() * topk_weights[rows, ks, None].float())
    return out.to(x.dtype)


def compute_on_host(
    experts: LayerExperts,
    kernel: HostKernel,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """``kernel`` on the slow tier's ``experts``; packed experts are decoded first (part
    of the host's work, so measured with it)."""
    if experts.decoder is None:
        return kernel(x, weights, ids, experts.tensors)
    distinct, local = torch.unique(ids, return_inverse=True)
    return kernel(x, weights, local.to(torch.int32), experts.decoded(distinct))


class HostCostModel:
    """Seconds of a host computation (emulated under an emulated link): least squares of
    ``per_expert * experts + per_row * rows`` ((token, expert) pairs), decayed, seeded
    by probes and refit online."""

    DECAY = 0.98

    def __init__(self) -> None:
        self._xtx = np.zeros((2, 2))
        self._xty = np.zeros(2)
        self.coef: np.ndarray | None = None
        """``[per_expert, per_row]`` seconds, once observed."""
        self.fixed = False

    def fix(self, per_expert: float, per_row: float) -> None:
        """Use these coefficients and stop learning (costs measured beforehand, or a test
        that must not depend on machine load)."""
        self.coef = np.array([per_expert, per_row], dtype=np.float64)
        self.fixed = True

    def observe(self, experts: int, rows: int, seconds: float) -> None:
        if self.fixed:
            return
        v = np.array([experts, rows], dtype=np.float64)
        self._xtx = self.DECAY * self._xtx + np.outer(v, v)
        self._xty = self.DECAY * self._xty + v * seconds
        ridge = 1e-9 * np.eye(2) * max(np.trace(self._xtx), 1.0)
        coef = np.linalg.solve(self._xtx + ridge, self._xty)
        self.coef = np.maximum(coef, 0.0)

    def seconds(self, rows_per_expert: np.ndarray) -> np.ndarray:
        """Estimated seconds of each expert's computation given its row count."""
        assert self.coef is not None
        return self.coef[0] + self.coef[1] * np.asarray(rows_per_expert, dtype=np.float64)


class HostExperts:
    """One layer's experts computed on the host."""

    def __init__(
        self,
        experts: LayerExperts,
        kernel: HostKernel,
        slowdown: float | None,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.experts = experts
        self.kernel = kernel
        self.slowdown = slowdown
        """Emulated host/device time ratio, or ``None`` for real time."""
        self.timer = timer
        """Measures a host computation (seconds): changes what is charged, not the wall
        clock the emulated host's result is held to."""
        self.cost = HostCostModel()

    def estimate(self, rows_per_expert: np.ndarray) -> np.ndarray:
        """Per-expert host seconds for ``auto``; probes the kernel on first use."""
        if self.cost.coef is None:
            self._probe()
        return self.cost.seconds(rows_per_expert)

    def _probe(self) -> None:
        shape, dtype = self.experts.slot_shapes["w13_weight"]
        for attempt, rows in enumerate((1, 8, 1, 8)):
            x = torch.zeros(rows, shape[-1], dtype=dtype)
            ids = torch.zeros(rows, 1, dtype=torch.int32)
            start = self.timer()
            self._compute(x, torch.ones(rows, 1), ids)
            if attempt >= 2:  # the first pair only warms the kernel up
                self.cost.observe(1, rows, self._charged(self.timer() - start))

    def _compute(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return compute_on_host(self.experts, self.kernel, x, weights, ids)

    def _charged(self, measured: float) -> float:
        return measured * self.slowdown if self.slowdown is not None else measured

    def stage(
        self, x: torch.Tensor, topk_weights: torch.Tensor, ids: np.ndarray, on_host: np.ndarray
    ) -> HostJob:
        """Gather on the host the inputs of the entries ``on_host`` ([T, K] mask over
        ``ids``). Before the device kernel launch, so the host compute overlaps it."""
        rows = np.flatnonzero(on_host.any(axis=1))
        mask = on_host[rows]
        # Entries of these rows that are not for the host point at one of the row's host
        # experts with weight 0 (the kernel has a fixed top-k; adding 0 changes nothing).
        first = ids[rows, mask.argmax(axis=1)]
        host_ids = np.where(mask, ids[rows], first[:, None])
        store = next(iter(self.experts.tensors.values())).device
        index = torch.from_numpy(rows).to(x.device)
        weights = torch.where(torch.from_numpy(mask).to(x.device), topk_weights[index], 0.0)
        return HostJob(
            index=index,
            x=x[index].to(store),
            weights=weights.to(store),
            ids=torch.from_numpy(host_ids.astype(np.int32)),
            experts=len(np.unique(ids[on_host])),
            entries=int(mask.sum()),
        )

    def finish(self, job: HostJob, out: torch.Tensor, started_at: float) -> tuple[float, float]:
        """Compute ``job`` into ``out``; ``started_at``: the layer call's start. Returns
        (host seconds charged, seconds the call waited for the host)."""
        start = self.timer()
        y = self._compute(job.x, job.weights, job.ids)
        measured = self.timer() - start
        out[job.index] += y.to(out.device, non_blocking=True)
        charged = self._charged(measured)
        self.cost.observe(job.experts, job.entries, charged)
        waited = 0.0
        if self.slowdown is not None:
            ready_at = started_at + charged
            waited = max(0.0, ready_at - time.perf_counter())
            sleep_until(ready_at)
        return charged, waited


@dataclass
class HostJob:
    """Host-side inputs of one layer call's host entries (see :meth:`HostExperts.stage`)."""

    index: torch.Tensor
    """Rows of the layer's batch that have host entries (on the device)."""
    x: torch.Tensor
    weights: torch.Tensor
    """Routing weights of those rows, 0 for entries that are not the host's."""
    ids: torch.Tensor
    experts: int
    """Distinct experts computed."""
    entries: int
    """(token, expert) entries computed."""
