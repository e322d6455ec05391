"""One call of one offloaded MoE layer (:class:`LayerCall`), the one request object from
the adapter to the kernel: the engine, every place an expert can run
(:mod:`vllm_specexpert.places`) and the executor (:mod:`vllm_specexpert.execute`) take it."""

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


class _Unread(np.ndarray):
    __hash__ = object.__hash__  # type: ignore[assignment]  # (a shared dataclass default)


class _Uncounted(PhaseStats):
    __hash__ = object.__hash__


UNREAD = np.zeros((0, 0), dtype=np.int64).view(_Unread)
"""The host ids of a call not read yet (indexing it fails: nothing reads them unread)."""
UNREAD.flags.writeable = False
UNCOUNTED = _Uncounted()
"""The counters of a call the engine has not taken yet (the engine gives it its phase's)."""


@dataclass
class LayerCall:
    """One call of one offloaded MoE layer on some tokens of a forward pass: as the
    adapter hands it to the engine, and, once its ids are read and its phase's counters
    given (:meth:`on_host`), as the executor, the places and the kernel take it."""

    layer: str
    """The layer's name."""
    kernel: ExpertKernel
    x: torch.Tensor
    """``[T, H]`` the tokens' router input."""
    topk_weights: torch.Tensor
    """``[T, K]`` the routing to run (the router's, or a prediction under ``speculate``)."""
    topk_ids: torch.Tensor
    """``[T, K]`` its expert ids, on the device."""
    phases: PassPhases | None = None
    """Which rows are decode tokens (``None``: all)."""
    mixed: bool = False
    """Rows of a pass that also ran prompt rows (its time is not a decode step's)."""
    host_ids: np.ndarray = UNREAD
    """The same ids on the host, once read."""
    stats: PhaseStats = UNCOUNTED
    """Counters of the call's phase (decode or prefill), once the engine took it."""
    before_kernel: Callable[[], None] | None = None
    """Called once, when the first launch's experts are resident and before it starts
    (the engine submits the next layer's prefetch there, so that the copy overlaps this
    layer's expert compute)."""

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    def on_host(self, stats: PhaseStats) -> LayerCall:
        """The call with its router's ids read to the host, counted in ``stats``."""
        return dataclasses.replace(self, host_ids=self.topk_ids.cpu().numpy(), stats=stats)

    def rows(
        self, index: np.ndarray, weights: torch.Tensor | None = None, ids: np.ndarray | None = None
    ) -> LayerCall:
        """The call on the tokens ``index`` (host row numbers), all of one phase;
        ``weights`` and ``ids`` (host), already of those rows, replace their routing if
        given."""
        device_index = upload(index, self.x.device)
        if ids is None:
            topk_ids = self.topk_ids[device_index]
            ids = self.host_ids[index] if self.host_ids is not UNREAD else UNREAD
        else:
            topk_ids = upload(ids, self.x.device).to(self.topk_ids.dtype)
        if weights is None:
            weights = self.topk_weights[device_index]
        return dataclasses.replace(
            self,
            x=self.x[device_index],
            topk_weights=weights,
            topk_ids=topk_ids,
            host_ids=ids,
            phases=None,
            mixed=self.mixed or (self.phases is not None and not self.phases.all_decode),
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
