"""Experts computed on the host as an engine feature (``cpu``, ``auto``, ``auto_buddy``):
each layer's place :data:`~vllm_specexpert.policy.cpu.HOST`, which computes its entries
from the slow tier while the device runs its own."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.places import Place, PlaceCounters
from vllm_specexpert.policy.cpu import HOST
from vllm_specexpert.stats import counter, seconds
from vllm_specexpert.tiers.host import HostExperts
from vllm_specexpert.tiers.store import LayerExperts


@dataclass
class HostCounters(PlaceCounters):
    entries_field = "host_entries"
    host_entries: int = counter(
        "Missed entries computed on the host from the slow tier (``cpu``, ``auto``)."
    )
    host_experts: int = counter("Distinct experts computed on the host, summed over layer calls.")
    host_s: float = seconds(
        "Seconds of host expert compute (modeled seconds with an emulated link: "
        "measured time x ``link.host_slowdown``)."
    )
    host_stall_s: float = seconds(
        "Seconds layer calls waited for the host after their device work was done."
    )


class HostPlace(Place):
    """Entries computed on the host from the slow tier, while the device runs its own."""

    name = HOST
    counters = HostCounters
    admits = True

    def __init__(self, host: HostExperts):
        self.host = host

    def estimate(self, rows: np.ndarray) -> np.ndarray:
        return self.host.estimate(rows)

    def stage(self, call: LayerCall, entries: np.ndarray) -> tuple[LayerCall, Any, float]:
        staged = self.host.stage(call.x, call.topk_weights, call.host_ids, entries)
        return call, staged, time.perf_counter()

    def finish(self, job: tuple[LayerCall, Any, float], out: torch.Tensor) -> None:
        call, staged, started_at = job
        charged, waited = self.host.finish(staged, out, started_at)
        counters = call.stats.part(HostCounters)
        counters.host_experts += staged.experts
        counters.host_s += charged
        counters.host_stall_s += waited
        return None


class HostComputeFeature(EngineFeature):
    name = "host_compute"

    def __init__(self, parts: EngineParts):
        link = parts.config.link
        self.slowdown = link.host_slowdown if link.emulated else None

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        return cls(parts) if parts.config.miss_policy_spec.computes_on_host else None

    @classmethod
    def check(cls, parts: EngineParts, inputs: Inputs) -> None:
        policy = parts.config.miss_policy_spec
        if policy.computes_on_host and any(
            layer.host_kernel is None for layer in parts.layers.values()
        ):
            raise SpecExpertConfigError(
                "miss_policy",
                f"'{policy.name}' computes experts on the host, and this "
                "model's expert layers have no host kernel",
                "use 'fetch' (this layer type cannot compute experts on the host)",
            )

    def equip(self, layer: OffloadedLayer) -> None:
        # Host compute reads the experts where they are: in host memory.
        if layer.host_kernel is not None and isinstance(layer.experts, LayerExperts):
            host = HostExperts(layer.experts, layer.host_kernel, self.slowdown)
            layer.add_place(HostPlace(host))

    def unequip(self, layer: OffloadedLayer) -> None:
        layer.places.unregister(HOST)


FEATURE = HostComputeFeature
