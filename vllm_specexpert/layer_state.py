"""One offloaded MoE layer's state in the engine, and what a config needs of the loaded
layers."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.planner.prefetch import PrefetchPlanner
from vllm_specexpert.policy import MissContext, miss_context
from vllm_specexpert.predict import NextLayerRouting, PredictorInputs
from vllm_specexpert.stats import LayerStats, PhaseStats
from vllm_specexpert.tiers.cache import ExpertCache
from vllm_specexpert.tiers.host import HostKernel
from vllm_specexpert.tiers.layer_peers import LayerPeers
from vllm_specexpert.tiers.link import Link
from vllm_specexpert.tiers.loader import ExpertLoader
from vllm_specexpert.tiers.slots import SlotPool
from vllm_specexpert.tiers.store import ExpertSource, ExpertStore

LOW_BIT_SUFFIX = ".int4"
"""Store name of a layer's INT4 copies beside its experts (``lowbit``): the adapter adds
them as ``name + LOW_BIT_SUFFIX`` before the layer."""


@dataclass
class OffloadedLayer:
    """One offloaded MoE layer: its cache, loader, counters and wiring."""

    name: str
    top_k: int
    index: int
    """Decoder-layer index in the model (``exact_layers`` refers to it)."""
    experts: ExpertSource
    """Its experts in the slow tier."""
    cache: ExpertCache = field(init=False)
    """Set by :meth:`equip` (as are ``loader``, ``low_bit``, ``prefetch``)."""
    loader: ExpertLoader = field(init=False)
    stats: LayerStats = field(default_factory=LayerStats)
    host_kernel: HostKernel | None = None
    """Fused experts on host tensors (``cpu``/``auto`` miss policies)."""
    next_name: str | None = None
    """The next offloaded MoE layer, once :meth:`OffloadEngine.link_layers` ran."""
    next_routing: NextLayerRouting | None = None
    prefetch: PrefetchPlanner = field(init=False)
    """The predictions made for this layer: their precision, what to prefetch."""
    coactivation: np.ndarray | None = None
    """``[E, E]`` calibrated co-activation counts (buddy lists)."""
    tae_percentiles: np.ndarray | None = None
    """``[101]`` calibrated percentiles of the Token Activating Entropy (tau)."""
    miss_context: MissContext | None = None
    """What the miss policy consults about this layer for decode tokens."""
    low_bit_experts: ExpertSource | None = None
    """INT4 copies of the layer's experts in the slow tier (made at load for
    ``lowbit``)."""
    low_bit: ExpertLoader | None = None
    """The layer's low-bit slots and their loader, under ``lowbit``."""
    peers: LayerPeers | None = None
    """The mesh peers that hold this layer's experts (``mesh``)."""
    local_experts: np.ndarray | None = None
    """Experts pinned in the device cache for good (``mesh.placement: replicate_hot``)."""
    pool_reach: int | None = None
    """Most elements of one slot-pool tensor its kernel can address (``None``: no
    limit), from the adapter's kernel (:mod:`vllm_specexpert.layers.slot_kernel`)."""
    router_skippable: bool = False
    """Its router can be skipped (``router_free``: wrappers installed at start)."""
    _equipped_for: tuple[SpecExpertConfig, Link] = field(init=False, repr=False)
    """The config and link of the last :meth:`equip` (a later miss context's)."""

    @classmethod
    def of(
        cls,
        store: ExpertStore,
        name: str,
        top_k: int,
        index: int,
        host_kernel: HostKernel | None = None,
        pool_reach: int | None = None,
    ) -> OffloadedLayer:
        """Layer ``name`` of ``store``, with its INT4 copies if the store has them."""
        return cls(
            name=name,
            top_k=top_k,
            index=index,
            experts=store.layers[name],
            host_kernel=host_kernel,
            pool_reach=pool_reach,
            low_bit_experts=store.layers.get(name + LOW_BIT_SUFFIX),
        )

    @property
    def equipped(self) -> bool:
        """Whether :meth:`equip` gave it a cache (a draft's layers load after its target's
        start; a rebuild drops them first)."""
        return "cache" in self.__dict__

    def unequip(self) -> None:
        """Drop its cache, loader and low-bit slots, their own pools' memory at once
        (freed before a rebuild makes new ones; a shared pool is the engine's)."""
        caches = [self.__dict__.get("cache"), self.low_bit.cache if self.low_bit else None]
        for cache in caches:
            if cache is not None and not cache.pool.shared:
                cache.pool.release()
        for name in ("cache", "loader"):
            self.__dict__.pop(name, None)
        self.low_bit = None

    def equip(
        self,
        config: SpecExpertConfig,
        slots: int,
        link: Link,
        device: torch.device,
        pool: SlotPool | None,
    ) -> None:
        """A cache of ``slots`` (its own pool, or its share of the shared ``pool``, which
        the engine allocates once every layer joined), loader, low-bit slots and miss
        context for ``config``."""
        low_bit = (
            config.miss_policy_spec.low_bit
            and self.low_bit_experts is not None
            and slots >= 2 * self.top_k
        )  # else check_low_bit says why
        if low_bit:  # the low-bit slots come out of the layer's budget
            slots -= self.top_k
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
                "use cache 'lru'",
            ) from error
        self.loader = ExpertLoader(self.cache, link)
        self.low_bit = None
        if low_bit and self.low_bit_experts is not None:
            self.low_bit = ExpertLoader(
                ExpertCache(self.low_bit_experts, self.top_k, self.top_k, "lru", device), link
            )
        self.prefetch = PrefetchPlanner(self.top_k)
        self._equipped_for = (config, link)
        if self.local_experts is not None:
            self._pin(self.local_experts, slots)
        self.set_miss_context(config, link)

    def join_peers(self, peers: LayerPeers, local: np.ndarray | None) -> None:
        """Ask ``peers`` for the layer's missing experts (``mesh``), with ``local``
        experts pinned in the device cache instead (``replicate_hot``); kept through
        every later :meth:`equip`."""
        self.peers, self.local_experts = peers, local
        if local is not None:
            self._pin(local, self.cache.num_slots)
        self.set_miss_context(*self._equipped_for)

    def _pin(self, experts: np.ndarray, slots: int) -> None:
        """Load ``experts`` into the cache now and never evict them."""
        if len(experts) > slots - self.top_k:
            raise SpecExpertConfigError(
                "mesh.hot_count",
                f"{len(experts)} pinned experts leave fewer than top_k "
                f"({self.top_k}) of the layer's {slots} slots for the others",
                f"use hot_count <= {slots - self.top_k}, or a larger budget",
            )
        self.loader.acquire(np.asarray(experts), PhaseStats())
        self.loader.wait_all()
        self.cache.policy.pinned[experts] = True

    def set_miss_context(self, config: SpecExpertConfig, link: Link) -> None:
        self.miss_context = miss_context(
            config,
            self.experts,
            functools.partial(link.expert_seconds, self.experts),
            self.host_kernel,
            self.coactivation,
            self.tae_percentiles,
            self.low_bit,
            self.peers,
        )


def check_pool_reach(
    config: SpecExpertConfig, planned: Iterable[tuple[OffloadedLayer, int]]
) -> None:
    """Raise a config error when a slot pool ``config`` would make of the ``planned``
    layers (each with its slots) is a tensor larger than their kernel can address (their
    ``pool_reach``): one pool per layer, or one for all layers under a shared-pool
    ``cache`` (``plec``)."""
    planned = [(la, n) for la, n in planned if la.pool_reach is not None]
    if not planned:
        return
    layers = [la for la, _ in planned]
    slots = [n for _, n in planned]
    limit = min(la.pool_reach for la in layers if la.pool_reach is not None)
    widest = max(math.prod(shape) for la in layers for shape, _ in la.experts.slot_shapes.values())
    pooled = sum(slots) if config.cache_spec.shared_pool else max(slots)
    if pooled * widest <= limit:
        return
    reach = limit // widest
    why = f"and the expert kernel addresses at most 2^{(limit + 1).bit_length() - 1}"
    if config.cache_spec.shared_pool:
        raise SpecExpertConfigError(
            "cache",
            f"'{config.cache}' puts all {len(layers)} layers' {sum(slots)} slots in one "
            f"pool of {pooled * widest / 1e9:.2f} G elements per tensor, {why}",
            f"use a per-layer cache (lru, lfu, static), or a budget of at most "
            f"{reach} slots in all ({reach // len(layers)} per layer)",
        )
    raise SpecExpertConfigError(
        "budget",
        f"{pooled} slots per layer make a pool of {pooled * widest / 1e9:.2f} G elements "
        f"per tensor, {why}",
        f"a budget of at most {reach} slots per layer",
    )


def check_runnable(
    config: SpecExpertConfig, layers: Iterable[OffloadedLayer], inputs: PredictorInputs
) -> None:
    """Raise a config error when ``config`` needs what the loaded ``layers`` lack (at
    engine start and before a ``reconfigure``: never mid-generation)."""
    layers = list(layers)
    for layer in layers:
        config.check_fits(layer.experts.num_experts, layer.top_k, layer.experts.packed_format)
    policy = config.miss_policy_spec
    if policy.computes_on_host and any(layer.host_kernel is None for layer in layers):
        raise SpecExpertConfigError(
            "miss_policy",
            f"'{policy.name}' computes experts on the host, and this "
            "model's expert layers have no host kernel",
            "use 'fetch' (this layer type cannot compute experts on the host)",
        )
    if config.routing_statistics_need is not None and any(
        layer.coactivation is None for layer in layers
    ):
        raise SpecExpertConfigError(
            "calibration",
            f"miss_policy '{policy.name}' needs the calibration's "
            "co-activation counts and TAE percentiles, loaded at engine start",
            "start the engine with 'calibration' set to a directory from "
            "`specexpert calibrate` for this model",
        )
    if policy.low_bit:
        check_low_bit(config, layers)
    moe_layers = sorted(layer.index for layer in layers)
    unknown = sorted(set(config.exact_layers or ()) - set(moe_layers))
    if unknown:
        raise SpecExpertConfigError(
            "exact_layers",
            f"{unknown} are not MoE layers of this model",
            f"give indices among its MoE layers {moe_layers}",
        )
    predictor = config.predictor_spec
    if predictor.needs_calibration and not inputs.default_vectors:
        raise SpecExpertConfigError(
            "predictor",
            f"{config.predictor} needs the calibration's default vectors, loaded at engine start",
            "start the engine with 'calibration' set",
        )
    if config.router_free and not any(layer.router_skippable for layer in layers):
        raise SpecExpertConfigError(
            "router_free",
            "skips routers in Python per call, and this engine's MoE "
            "runner is traced into torch.compile's graph (the CPU build's compiled mode)",
            "start the engine with enforce_eager=True (--enforce-eager), or remove it",
        )
    if predictor.needs_estimator and inputs.estimator is None:
        raise SpecExpertConfigError(
            "predictor",
            f"{config.predictor} needs the estimator, loaded at engine start",
            "start the engine with 'estimator' set",
        )


def check_low_bit(config: SpecExpertConfig, layers: list[OffloadedLayer]) -> None:
    """``lowbit`` needs each layer's INT4 copies (its budget and the experts' format:
    :meth:`SpecExpertConfig.check_fits`)."""
    if any(layer.low_bit_experts is None for layer in layers):
        raise SpecExpertConfigError(
            "miss_policy",
            "'lowbit' runs INT4 copies of the experts, made at load "
            "only when the engine starts with miss_policy 'lowbit'",
            "start the engine with miss_policy 'lowbit' (reconfigure can then "
            "switch to any other policy and back)",
        )


def check_change(
    current: SpecExpertConfig,
    config: SpecExpertConfig,
    layers: Iterable[OffloadedLayer],
    inputs: PredictorInputs,
) -> None:
    """Raise a config error unless the running engine can switch from ``current`` to
    ``config`` (``reconfigure``): the budget fits every layer, the artifacts read at
    start are the same, and the new mode can run on the loaded layers."""
    layers = list(layers)
    for name in (
        "calibration",
        "estimator",
        "analysis",
        "hybrid_threshold",
        "path_predictor",
        "token_scheduler",
    ):
        if getattr(config, name) != getattr(current, name):
            raise SpecExpertConfigError(
                name,
                "is read when the engine starts and cannot change at run time",
                f"start a new engine with the new '{name}'",
            )
    if config.disk != current.disk:
        raise SpecExpertConfigError(
            "disk",
            "the pack is opened and checked when the engine starts",
            "start a new engine with the new 'disk'",
        )
    before, after = current.mesh, config.mesh
    if (before is None) != (after is None) or (
        before is not None
        and any(
            getattr(before, f) != getattr(after, f)
            for f in ("ray_address", "peers", "placement", "hot_count")
        )
    ):
        raise SpecExpertConfigError(
            "mesh",
            "its peers and their shards are made when the engine starts; only "
            "mesh.mode, rtt_cap_ms, timeout_ms and probe_interval_s can change at run time",
            "start a new engine with the new 'mesh'",
        )
    drafts = current.lookahead, config.lookahead
    if (drafts[0] is None) != (drafts[1] is None) or (
        drafts[0] is not None
        and drafts[1] is not None
        and (drafts[0].k_max, drafts[0].draft_budget) != (drafts[1].k_max, drafts[1].draft_budget)
    ):
        raise SpecExpertConfigError(
            "lookahead",
            "is read when the engine starts (vLLM's speculative decoding and "
            "the draft are built then); only lookahead.k can change at run time",
            "start a new engine with the new 'lookahead'",
        )
    check_runnable(config, layers, inputs)
