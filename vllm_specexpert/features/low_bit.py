"""``lowbit``: run a missing expert's INT4 copy (HOBBIT).

A missing expert's INT4 copy (made at load, a quarter of the bytes) is moved into the
layer's low-bit slots (``top_k`` of its budget), dequantized and run with the same
kernel; missing experts beyond those slots are fetched in bf16 (the most used get the
low-bit slots). With ``admit_host_experts`` the bf16 expert is then loaded on an idle
link (docs/design.md, "``lowbit``").

The mode in one module: per layer, the low-bit slots taken out of its budget and their
loader, the place :class:`LowBitPlace` where the policy runs a missing expert's copy,
its counters, the policy built with it, and the feature that equips the layers. The
copies are made at load, beside the layer's experts in the store
(:data:`LOW_BIT_SUFFIX`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.config.modes import MISS_POLICIES
from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.places import Place, PlaceCounters
from vllm_specexpert.policy import MissContext, MissPlan, PlacedPolicy
from vllm_specexpert.stats import PhaseStats, counter
from vllm_specexpert.tiers.cache import ExpertCache
from vllm_specexpert.tiers.loader import ExpertLoader
from vllm_specexpert.tiers.store import LOW_BIT_SUFFIX, ExpertSource


@dataclass
class LowBitCounters(PlaceCounters):
    entries_field = "low_bit_entries"
    low_bit_entries: int = counter(
        "Missed entries run from the expert's INT4 copy (``lowbit``; output not exact)."
    )
    low_bit_loads: int = counter(
        "INT4 copies moved into the layer's low-bit slots (packed; also counted in "
        "``bytes_loaded``, not in ``loads``)."
    )
    low_bit_bytes: int = counter("Bytes of those INT4 copies.")


class LowBitPlace(Place):
    """Entries run from their expert's INT4 copy, loaded (packed) into the layer's
    low-bit slots: one kernel launch on those slots. Its loads count as ``low_bit_*``
    (and in ``bytes_loaded``), not as the cache's."""

    name = "low_bit"
    counters = LowBitCounters
    admits = True

    def __init__(self, loader: ExpertLoader):
        self.loader = loader

    @property
    def room(self) -> int:
        return self.loader.cache.num_slots

    def stage(self, call: LayerCall, entries: np.ndarray) -> tuple[LayerCall, np.ndarray]:
        return call, entries  # runs in finish: it shares the device with the kernel

    def finish(self, job: tuple[LayerCall, np.ndarray], out: torch.Tensor) -> None:
        call, entries = job
        ids, stats, low_bit = call.host_ids, call.stats, self.loader
        scratch = PhaseStats()
        low_bit.acquire(np.unique(ids[entries]), scratch)  # demand copies count at once
        counters = stats.part(LowBitCounters)
        counters.low_bit_loads += scratch.loads
        counters.low_bit_bytes += scratch.bytes_loaded
        stats.bytes_loaded += scratch.bytes_loaded
        stats.stall_s += scratch.stall_s
        index, part = call.masked(entries)
        routing = low_bit.cache.kernel_routing(part.topk_ids, part.host_ids)
        out[index] += part.kernel(
            part.x, part.topk_weights, routing.ids, routing.slots, routing.expert_map
        )
        low_bit.kernel_launched(np.unique(ids[entries]))
        stats.kernel_calls += 1
        return None


class LowBitPolicy(PlacedPolicy):
    spec = MISS_POLICIES["lowbit"]
    place_kind = LowBitPlace
    place: LowBitPlace

    def plan(
        self,
        ids: np.ndarray,
        resident: np.ndarray,
        topk_weights: torch.Tensor,
        context: MissContext,
    ) -> MissPlan:
        missing = ~resident[ids]
        experts, rows = np.unique(ids[missing], return_counts=True)
        if len(experts) > self.place.room:  # the most used run low-bit, the rest are fetched
            experts = experts[np.argsort(-rows, kind="stable")[: self.place.room]]
        return MissPlan(topk_ids=ids, places={LowBitPlace.name: missing & np.isin(ids, experts)})


class LowBitFeature(EngineFeature):
    name = "low_bit"

    def __init__(self, parts: EngineParts):
        self.parts = parts
        self.loaders: dict[str, ExpertLoader] = {}
        """Layer name -> its low-bit slots' loader."""

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        return cls(parts) if parts.config.miss_policy_spec.low_bit else None

    @classmethod
    def check(cls, parts: EngineParts, inputs: Inputs) -> None:
        if parts.config.miss_policy_spec.low_bit and any(
            _copies(parts, name) is None for name in parts.layers
        ):
            raise SpecExpertConfigError(
                "miss_policy",
                "'lowbit' runs INT4 copies of the experts, made at load "
                "only when the engine starts with miss_policy 'lowbit'",
                "start the engine with miss_policy 'lowbit' (reconfigure can then "
                "switch to any other policy and back)",
            )

    def reserved_slots(self, layer: OffloadedLayer, slots: int) -> int:
        # Too few slots for both: SpecExpertConfig.check_fits says why at start.
        has_room = slots >= 2 * layer.top_k
        return layer.top_k if has_room and _copies(self.parts, layer.name) is not None else 0

    def equip(self, layer: OffloadedLayer) -> None:
        copies = _copies(self.parts, layer.name)
        if copies is None or layer.name in self.loaders:
            return
        cache = ExpertCache(copies, layer.top_k, layer.top_k, "lru", layer.cache.device)
        loader = self.loaders[layer.name] = ExpertLoader(cache, self.parts.link)
        layer.add_place(LowBitPlace(loader))

    def unequip(self, layer: OffloadedLayer) -> None:
        loader = self.loaders.pop(layer.name, None)
        if loader is not None:
            loader.cache.pool.release()
            layer.places.unregister(LowBitPlace.name)

    def summary(self) -> str:
        loader = next(iter(self.loaders.values()), None)
        if loader is None:
            return ""
        experts = loader.cache.experts
        return (
            f"; their {experts.format} copies ({experts.expert_nbytes / 1e3:.1f} kB) in "
            f"{loader.cache.num_slots} low-bit slots per layer"
        )


def _copies(parts: EngineParts, name: str) -> ExpertSource | None:
    return parts.store.layers.get(name + LOW_BIT_SUFFIX)


POLICIES = (LowBitPolicy,)
FEATURE = LowBitFeature
