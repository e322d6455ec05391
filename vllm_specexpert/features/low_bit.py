"""INT4 copies of the experts as an engine feature (``lowbit``): per layer, a few
low-bit slots taken out of its budget and their loader, the place
:data:`~vllm_specexpert.policy.lowbit.LOW_BIT` where the ``lowbit`` miss policy runs a
missing expert's copy (:mod:`vllm_specexpert.policy.lowbit`). The copies are made at
load, beside the layer's experts in the store (:data:`LOW_BIT_SUFFIX`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.places import Place, PlaceCounters
from vllm_specexpert.policy.lowbit import LOW_BIT
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

    name = LOW_BIT
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
            layer.places.unregister(LOW_BIT)

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


FEATURE = LowBitFeature
