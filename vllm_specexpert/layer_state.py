"""One offloaded MoE layer's state in the engine, and what a config needs of the loaded
layers."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.planner.prefetch import PrefetchPlanner
from vllm_specexpert.policy import MissContext
from vllm_specexpert.predict import NextLayerRouting
from vllm_specexpert.stats import LayerStats
from vllm_specexpert.tiers.cache import ExpertCache
from vllm_specexpert.tiers.host import HostKernel
from vllm_specexpert.tiers.loader import ExpertLoader


@dataclass
class OffloadedLayer:
    """One offloaded MoE layer: its cache, loader, counters and wiring."""

    name: str
    top_k: int
    index: int
    """Decoder-layer index in the model (``exact_layers`` refers to it)."""
    cache: ExpertCache
    loader: ExpertLoader
    stats: LayerStats = field(default_factory=LayerStats)
    host_kernel: HostKernel | None = None
    """Fused experts on host tensors (``cpu``/``auto`` miss policies)."""
    next_name: str | None = None
    """The next offloaded MoE layer, once :meth:`OffloadEngine.link_layers` ran."""
    next_routing: NextLayerRouting | None = None
    prefetch: PrefetchPlanner | None = None
    """The predictions made for this layer: their precision, what to prefetch."""
    coactivation: np.ndarray | None = None
    """``[E, E]`` calibrated co-activation counts (buddy lists)."""
    tae_percentiles: np.ndarray | None = None
    """``[101]`` calibrated percentiles of the Token Activating Entropy (tau)."""
    miss_context: MissContext | None = None
    """What the miss policy consults about this layer for decode tokens."""


def check_runnable(config: SpecExpertConfig, layers: Iterable[OffloadedLayer],
                   has_default_vectors: bool) -> None:
    """Raise a config error when ``config`` needs what the loaded ``layers`` lack (at
    engine start and before a ``reconfigure``: never mid-generation)."""
    layers = list(layers)
    policy = config.miss_policy_spec
    if policy.computes_on_host and any(
        layer.host_kernel is None for layer in layers
    ):
        raise SpecExpertConfigError(
            "miss_policy", f"'{policy.name}' computes experts on the host, and this "
            "model's expert layers have no host kernel",
            "use 'fetch' (this layer type cannot compute experts on the host)")
    if config.routing_statistics_need is not None and any(
        layer.coactivation is None for layer in layers
    ):
        raise SpecExpertConfigError(
            "calibration", f"miss_policy '{policy.name}' needs the calibration's "
            "co-activation counts and TAE percentiles, loaded at engine start",
            "start the engine with 'calibration' set to a directory from "
            "`specexpert calibrate` for this model")
    moe_layers = sorted(layer.index for layer in layers)
    unknown = sorted(set(config.exact_layers or ()) - set(moe_layers))
    if unknown:
        raise SpecExpertConfigError(
            "exact_layers", f"{unknown} are not MoE layers of this model",
            f"give indices among its MoE layers {moe_layers}")
    if config.predictor_spec.needs_calibration and not has_default_vectors:
        raise SpecExpertConfigError(
            "predictor", f"{config.predictor} needs the calibration's default vectors, "
            "loaded at engine start", "start the engine with 'calibration' set")


def check_change(current: SpecExpertConfig, config: SpecExpertConfig,
                 layers: Iterable[OffloadedLayer], has_default_vectors: bool) -> None:
    """Raise a config error unless the running engine can switch from ``current`` to
    ``config`` (``reconfigure``): the budget fits every layer, the artifacts read at
    start are the same, and the new mode can run on the loaded layers."""
    layers = list(layers)
    for layer in layers:
        config.slots_per_layer(layer.cache.num_experts, layer.top_k)
    for name in ("calibration", "path_predictor", "token_scheduler"):
        if getattr(config, name) != getattr(current, name):
            raise SpecExpertConfigError(
                name, "is read when the engine starts and cannot change at run time",
                f"start a new engine with the new '{name}'")
    check_runnable(config, layers, has_default_vectors)
