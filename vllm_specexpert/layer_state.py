"""One offloaded MoE layer's state in the engine: what every layer has, whatever runs.
A feature keeps its own per-layer state (:mod:`vllm_specexpert.features`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.places import Place, Places
from vllm_specexpert.policy import MissContext
from vllm_specexpert.stats import PHASES, Counters, LayerStats
from vllm_specexpert.tiers.cache import ExpertCache
from vllm_specexpert.tiers.host import HostKernel
from vllm_specexpert.tiers.link import Link
from vllm_specexpert.tiers.loader import ExpertLoader
from vllm_specexpert.tiers.slots import SlotPool
from vllm_specexpert.tiers.store import ExpertSource


@dataclass
class OffloadedLayer:
    """One offloaded MoE layer: its experts, cache, loader, counters and successor."""

    name: str
    top_k: int
    index: int
    """Decoder-layer index in the model (``exact_layers`` refers to it)."""
    experts: ExpertSource
    """Its experts in the slow tier."""
    host_kernel: HostKernel | None = None
    """Fused experts on host tensors (``cpu``/``auto`` miss policies)."""
    pool_reach: int | None = None
    """Most elements of one slot-pool tensor its kernel can address (``None``: no
    limit), from the adapter's kernel (:mod:`vllm_specexpert.layers.slot_kernel`)."""
    next_name: str | None = None
    """The next offloaded MoE layer, once :meth:`OffloadEngine.link_layers` ran."""
    stats: LayerStats = field(default_factory=LayerStats)
    counter_kinds: list[type[Counters]] = field(default_factory=list)
    """The counters running features keep per phase beside the engine's
    (:meth:`add_counters`); a place's come with the place (:meth:`add_place`)."""
    cache: ExpertCache = field(init=False)
    """Set by :meth:`equip`, as are ``loader``, ``places`` and ``miss_context``."""
    loader: ExpertLoader = field(init=False)
    places: Places = field(init=False)
    """Where its entries run besides its slots: the features register them (:meth:`add_place`)."""
    miss_context: MissContext = field(init=False)
    """What the miss policy consults about this layer."""

    def add_place(self, place: Place) -> None:
        """Register ``place``; its counters are then in the layer's stats, at zero."""
        self.places.register(place)
        self._show_counters()

    def add_counters(self, kind: type[Counters]) -> None:
        """A running feature's counters in the layer's stats from now on, at zero."""
        if kind not in self.counter_kinds:
            self.counter_kinds.append(kind)
        self._show_counters()

    def remove_counters(self, kind: type[Counters]) -> None:
        """The feature stopped: its counters are gone from the stats after a reset."""
        if kind in self.counter_kinds:
            self.counter_kinds.remove(kind)

    def reset_stats(self) -> None:
        """Every counter at zero, the features' and places' among them."""
        self.stats = LayerStats()
        self._show_counters()

    def _show_counters(self) -> None:
        """Each running feature's and place's counters in both phases' stats (at zero
        until they count)."""
        places = self.__dict__.get("places", ())  # (none before it is equipped)
        for kind in [*(place.counters for place in places), *self.counter_kinds]:
            for phase in PHASES:
                getattr(self.stats, phase).part(kind)

    @property
    def equipped(self) -> bool:
        """Whether :meth:`equip` gave it a cache (a draft's layers load after its target's
        start; a rebuild drops them first)."""
        return "cache" in self.__dict__

    def unequip(self) -> None:
        """Drop its cache and loader, its own pool's memory at once (freed before a
        rebuild makes new ones; a shared pool is the engine's)."""
        cache = self.__dict__.pop("cache", None)
        if cache is not None and not cache.pool.shared:
            cache.pool.release()
        self.__dict__.pop("loader", None)

    def equip(
        self,
        config: SpecExpertConfig,
        slots: int,
        link: Link,
        device: torch.device,
        pool: SlotPool | None,
    ) -> None:
        """A cache of ``slots`` (its own pool, or its share of the shared ``pool``, which
        the engine allocates once every layer joined), its loader, places (none yet but
        :class:`~vllm_specexpert.places.Dropped`) and miss context."""
        try:
            self.cache = ExpertCache(
                self.experts, slots, self.top_k, config.cache, device, pool=pool
            )
        except ValueError as error:
            if pool is None:
                raise
            raise SpecExpertConfigError(
                "cache",
                f"'{config.cache}' shares one slot pool between layers: {error}",
                "use cache 'lrfu'",
            ) from error
        self.loader = ExpertLoader(self.cache, link)
        self.places = Places()
        self.miss_context = MissContext(
            functools.partial(link.expert_seconds, self.experts),
            self.places,
            config.miss_policy_spec.computes_elsewhere and config.admit_host_experts,
        )
        self._show_counters()
