"""The run of a layer whose experts are not all in the slots of their ids: every expert
a call needs is acquired (loaded if missing, each once) and the call runs in one launch,
with vanilla's rounding; where they cannot all fit the pool (own slots and, on the CPU
build's disk tier, the shared region's rows), its ``overflow`` runs the call. Which
overflow a layer has is chosen when it is composed (:func:`device_run_for`), never on a
call. :func:`survey` tells what a call's routing finds in the cache; a call with every
entry on the device (``fetch``, every prefill pass: the bit-exact path) is
:meth:`OneLaunch.run_all`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from vllm_specexpert.device_runs import kernel_launch
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.tiers.loader import ExpertLoader


@dataclass
class Survey:
    """What a call's routing finds in the cache."""

    resident: np.ndarray
    """``[E]`` experts that count as resident (landed ones only, for a policy that does
    not wait for copies)."""
    missing: np.ndarray
    """``[T, K]`` entries whose expert is not resident."""
    missed: int
    """How many entries are missing."""
    needed: np.ndarray
    """The call's distinct experts."""


def survey(loader: ExpertLoader, call: LayerCall, waits_for_copies: bool = True) -> Survey:
    """The call's missing entries and distinct experts, counted."""
    resident = loader.cache.resident_mask() if waits_for_copies else loader.ready_mask()
    missing = ~resident[call.host_ids]
    missed = int(np.count_nonzero(missing))
    call.stats.missed_entries += missed
    needed = np.unique(call.host_ids)
    call.stats.experts_needed += len(needed)
    return Survey(resident, missing, missed, needed)


class Overflow(Protocol):
    """How a call runs whose experts do not fit the pool together."""

    def run(self, loader: ExpertLoader, call: LayerCall) -> torch.Tensor: ...


class OneLaunch:
    """One launch over every expert a call needs, its ``overflow`` where they do not fit."""

    def __init__(self, overflow: Overflow) -> None:
        self.overflow = overflow

    def run_all(
        self, loader: ExpertLoader, call: LayerCall, found: Survey | None = None
    ) -> torch.Tensor:
        """Every entry of the call on the device, the missing ones loaded (counted as
        fetched): the bit-exact path. ``found``: the call's survey, if one was made."""
        found = survey(loader, call) if found is None else found
        call.stats.fetched_entries += found.missed
        return self.run(loader, call, found.needed)

    def run(self, loader: ExpertLoader, call: LayerCall, needed: np.ndarray) -> torch.Tensor:
        """Output of the call's kernel on its routing, loading what is missing;
        ``needed``: the call's distinct experts."""
        loader.begin_run(needed, call.stats)
        cache = loader.cache
        if not cache.capacity_for(needed):
            return self.overflow.run(loader, call)
        uses = None
        if cache.pool.region_rows:  # (the loads' most used go to the layer's own slots)
            uses = np.bincount(call.host_ids.ravel(), minlength=cache.num_experts)
        loader.acquire(needed, call.stats, tokens=len(call.host_ids), uses=uses)
        return kernel_launch.launch(loader, call, needed)
