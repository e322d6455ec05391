"""One call of one offloaded MoE layer: as the adapter hands it to the engine
(:class:`LayerRequest`), and on some of its tokens with their routing on the host, as
every place an expert can run (:mod:`vllm_specexpert.places`) and the executor
(:mod:`vllm_specexpert.execute`) are handed it (:class:`LayerCall`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_specexpert.phases import PassPhases
from vllm_specexpert.stats import PhaseStats
from vllm_specexpert.tiers.staging import upload

ExpertKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None],
    torch.Tensor,
]
"""``kernel(x, topk_weights, ids, slots, expert_map) -> out``: the layer's fused-experts
kernel run on the slot tensors ``slots`` (name -> ``[num_slots, ...]``). ``ids`` are slot
indices when ``expert_map`` is ``None``, else router expert ids that the kernel maps
through ``expert_map`` (id -> slot, -1: not resident), as vLLM's fused MoE does for
expert parallelism (see :meth:`ExpertCache.kernel_routing`)."""


@dataclass
class LayerRequest:
    """A forward pass's call of one offloaded MoE layer, before anything is read to the
    host."""

    layer: str
    """The layer's name."""
    kernel: ExpertKernel
    x: torch.Tensor
    """``[T, H]`` the tokens' router input."""
    topk_weights: torch.Tensor
    """``[T, K]`` the router's routing, on the device."""
    topk_ids: torch.Tensor
    phases: PassPhases | None = None
    """Which rows are decode tokens (``None``: all)."""
    mixed: bool = False
    """Rows of a pass that also ran prompt rows (its time is not a decode step's)."""

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    @property
    def all_prefill(self) -> bool:
        return self.phases is not None and self.phases.all_prefill

    def rows(self, index: torch.Tensor) -> LayerRequest:
        """The request on the rows ``index`` (a device index), all of one phase."""
        return dataclasses.replace(
            self,
            x=self.x[index],
            topk_weights=self.topk_weights[index],
            topk_ids=self.topk_ids[index],
            phases=None,
            mixed=self.mixed or (self.phases is not None and not self.phases.all_decode),
        )

    def on_host(self, stats: PhaseStats) -> LayerCall:
        """The call with its router's ids read to the host, counted in ``stats``."""
        return LayerCall(
            self.x,
            self.topk_weights,
            self.topk_ids,
            self.topk_ids.cpu().numpy(),
            self.kernel,
            stats,
        )


@dataclass
class LayerCall:
    """One call of one offloaded MoE layer on some tokens of a forward pass."""

    x: torch.Tensor
    """``[T, H]`` the tokens' router input."""
    topk_weights: torch.Tensor
    """``[T, K]`` the routing to run (the router's, or a prediction under ``speculate``)."""
    topk_ids: torch.Tensor
    """``[T, K]`` its expert ids, on the device."""
    host_ids: np.ndarray
    """The same ids on the host."""
    kernel: ExpertKernel
    stats: PhaseStats
    """Counters of the call's phase (decode or prefill)."""
    before_kernel: Callable[[], None] | None = None
    """Called once, when the first launch's experts are resident and before it starts
    (the engine submits the next layer's prefetch there, so that the copy overlaps this
    layer's expert compute)."""

    def rows(
        self, index: np.ndarray, weights: torch.Tensor | None = None, ids: np.ndarray | None = None
    ) -> LayerCall:
        """The call on the tokens ``index`` (host row numbers); ``weights`` and ``ids``
        (host), already of those rows, replace their routing if given."""
        device_index = upload(index, self.x.device)
        if ids is None:
            ids, topk_ids = self.host_ids[index], self.topk_ids[device_index]
        else:
            topk_ids = upload(ids, self.x.device).to(self.topk_ids.dtype)
        if weights is None:
            weights = self.topk_weights[device_index]
        return dataclasses.replace(
            self, x=self.x[device_index], topk_weights=weights, topk_ids=topk_ids, host_ids=ids
        )

    def routed(self, weights: torch.Tensor, ids: np.ndarray) -> LayerCall:
        """The same tokens with another routing (``ids`` on the host)."""
        return dataclasses.replace(
            self,
            topk_weights=weights,
            host_ids=ids,
            topk_ids=upload(ids, self.x.device).to(self.topk_ids.dtype),
        )

    def take_before_kernel(self) -> Callable[[], None] | None:
        """``before_kernel``, once: later launches of the call get ``None``."""
        hook, self.before_kernel = self.before_kernel, None
        return hook

    def masked(self, entries: np.ndarray) -> tuple[torch.Tensor, LayerCall]:
        """The call on the rows that have some of ``entries`` ([T, K] mask), with those
        rows' device index. The row's other entries point at one of its ``entries`` with
        weight 0: the kernel has a fixed top-k, and adding 0 changes nothing."""
        weights = self.topk_weights
        rows = np.flatnonzero(entries.any(axis=1))
        mask = entries[rows]
        first = self.host_ids[rows, mask.argmax(axis=1)]
        index = upload(rows, self.x.device)
        part = self.rows(
            rows,
            torch.where(upload(mask, self.x.device), weights[index], 0.0),
            np.where(mask, self.host_ids[rows], first[:, None]),
        )
        return index, part
