"""Expert compute on the host, from the slow tier (``cpu`` and ``auto`` miss policies).

The llama.cpp/KTransformers answer to a miss, made per miss: instead of copying a
missing expert to the device, compute it where its weights already are, while the
device computes the resident ones, and add the two outputs.

* CPU build: the host kernel is vLLM's own CPU fused-experts kernel run on the store's
  tensors (they are in the same post-processed layout as the slots), so the host compute
  is real and measured. The device and the host are then the same processor, which would
  make ``cpu`` look free: with an emulated link, a host computation counts as ready only
  ``host_slowdown`` times its measured duration after the layer call started (the
  device's work runs in that window). The layer call is charged
  ``max(t_device + t_host, host_slowdown * t_host)``: at most ``t_host`` more than a GPU
  box's ``max(t_device, host_slowdown * t_host)``, i.e. conservative against ``cpu``.
* CUDA: the rows of ``x`` that need host experts are read back first (a sync on work
  the router's ids already waited for), then the device kernel is launched
  (asynchronous), the host computes its experts with :func:`torch_experts` on the pinned
  store meanwhile, and the result is copied back and added on the device stream. NOT
  RUN ON A GPU YET; :func:`torch_experts` itself is checked against a reference here.

:class:`HostCostModel` predicts a host computation's duration for ``auto``: seconds =
``per_expert * experts + per_row * rows``, seeded by two probes and refit online.
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
    """Seconds a host computation of ``experts`` experts over ``rows`` (token, expert)
    pairs takes (emulated seconds under an emulated link): a least-squares fit of
    ``per_expert * experts + per_row * rows`` over exponentially decayed observations."""

    DECAY = 0.98

    def __init__(self) -> None:
        self._xtx = np.zeros((2, 2))
        self._xty = np.zeros(2)
        self.coef: np.ndarray | None = None
        """``[per_expert, per_row]`` seconds, once observed."""
        self.fixed = False
        """Set by :meth:`fix`: the coefficients no longer follow observations."""

    def fix(self, per_expert: float, per_row: float) -> None:
        """Use these coefficients from now on and stop learning: a host whose costs were
        measured beforehand, or a test whose outcome must not depend on how loaded the
        machine is."""
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
    """One layer's experts computed on the host (see module doc)."""

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
        """What a host computation's duration is measured with (seconds). Another timer
        (a thread's CPU time on a shared machine, a test's) changes what is charged,
        not the wall clock the emulated host's result is held to."""
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
        """Gather, on the host, the inputs of the entries ``on_host`` ([T, K] mask over
        ``ids``). Called before the device kernel is launched: on CUDA this reads ``x``
        back (a sync on work the router already waited for), so that the host compute
        then overlaps the device kernel instead of waiting for it."""
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
        """Compute ``job`` and add it to ``out``. ``started_at`` is when the layer call
        started (the device's work counts as running in parallel from then). Returns
        (host seconds charged, seconds the call waited for the host beyond its own
        work)."""
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
