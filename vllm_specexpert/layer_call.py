"""One call of one offloaded MoE layer (:class:`LayerCall`), the one request object from
the adapter to the kernel: the engine, every place an expert can run
(:mod:`vllm_specexpert.places`) and the executor (:mod:`vllm_specexpert.execute`) take it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from vllm_specexpert.phases import PassPhases
from vllm_specexpert.stats import PhaseStats
from vllm_specexpert.tiers.staging import upload


class ExpertKernel(Protocol):
    """``kernel(x, topk_weights, ids, slots, expert_map, out=, tile_tokens=) -> out``: the
    layer's fused-experts kernel run on the slot tensors ``slots`` (name -> ``[num_slots,
    ...]``), a plain function of its inputs. ``ids`` are slot indices when ``expert_map``
    is ``None``, else router expert ids that the kernel maps through ``expert_map`` (id
    -> slot, -1: not resident), as vLLM's fused MoE does for expert parallelism (see
    :meth:`ExpertCache.kernel_routing`). ``out``: where to write the result, if given
    (a kernel that cannot returns a fresh tensor). ``tile_tokens``: the token count whose
    tile config the launch takes (CUDA: a part of a call sums as the whole call does)."""

    def __call__(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        ids: torch.Tensor,
        slots: dict[str, torch.Tensor],
        expert_map: torch.Tensor | None = None,
        /,
        *,
        out: torch.Tensor | None = None,
        tile_tokens: int = 0,
    ) -> torch.Tensor: ...


class FirstLaunch:
    """What starts once a call's first launch has its experts, before it runs: the next
    layer's prefetch or read ahead, which then overlap the layer's own expert compute.
    Every part of a call (its rows, token groups, windows) holds the same object, so
    whichever launches first runs it, once; nothing is taken or cleared."""

    __slots__ = ("_hooks", "pending")

    def __init__(self) -> None:
        self._hooks: list[Callable[[], None]] = []
        self.pending = False
        """Some hook has not run yet."""

    def add(self, hook: Callable[[], None]) -> None:
        self._hooks.append(hook)
        self.pending = True

    def run(self) -> None:
        """The hooks, once: later launches of the call run nothing."""
        hooks, self._hooks, self.pending = self._hooks, [], False
        for hook in hooks:
            hook()


class _NothingFirst(FirstLaunch):
    __slots__ = ()

    def add(self, hook: Callable[[], None]) -> None:
        raise TypeError("NOTHING_FIRST takes no hooks: give the call its own FirstLaunch")

    def run(self) -> None:
        pass


NOTHING_FIRST = _NothingFirst()
"""The :class:`FirstLaunch` of a call that starts nothing (the null object: shadow
computations, calls no stage planned for)."""


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
    first_launch: FirstLaunch = NOTHING_FIRST
    """Run once, when the call's first launch has its experts and before it starts
    (shared by every part of the call)."""
    out: torch.Tensor | None = None
    """Where the result of a launch on all of the call's rows goes (the custom op's
    buffer: a one-launch call needs no copy); a part of the call has none."""
    tile_tokens: int = 0
    """The token count of the call as the adapter handed it: every launch of it takes
    that count's tile config (CUDA; 0: the launch's own)."""

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
            out=None,
        )

    def routed(self, weights: torch.Tensor, ids: np.ndarray) -> LayerCall:
        """The same tokens with another routing (``ids`` on the host)."""
        return dataclasses.replace(
            self,
            topk_weights=weights,
            host_ids=ids,
            topk_ids=upload(ids, self.x.device).to(self.topk_ids.dtype),
        )

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
