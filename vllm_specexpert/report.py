"""Reporting: the engine's statistics as one dict (``get_stats``, ``stats_path``, the
``/metrics`` snapshots) and its one-line summary (the threads that write them to files:
:mod:`vllm_specexpert.stats_writers`)."""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Protocol

import torch

from vllm_specexpert.config.sizing import gib
from vllm_specexpert.stats import PHASES, LayerStats, Series, metric_name
from vllm_specexpert.tiers import slow_tiers

if TYPE_CHECKING:  # (the engine's parts: above this module, named for the type checker)
    from vllm_specexpert.budget_plan import BudgetPlan
    from vllm_specexpert.config import SpecExpertConfig
    from vllm_specexpert.features import EngineFeature
    from vllm_specexpert.layer_state import OffloadedLayer
    from vllm_specexpert.read_ahead import LaunchProbe
    from vllm_specexpert.tiers.link import Link
    from vllm_specexpert.tiers.store import ExpertStore

STATS_SCHEMA_VERSION = 6
"""``schema_version`` of :func:`engine_stats` (each worker's ``get_stats`` dict, the
``stats_path`` file): a key whose type changes, or that is no longer always there,
bumps it and gets a line in ``docs/changelog.md``."""


class ReportedEngine(Protocol):
    """What reporting reads of an ``OffloadEngine`` (which imports this module: named
    here, not imported)."""

    config: SpecExpertConfig
    layers: dict[str, OffloadedLayer]
    lock: threading.Lock
    rank: int
    device: torch.device
    store: ExpertStore
    link: Link
    features: list[EngineFeature]
    budget: BudgetPlan
    region_refused: str | None
    launch_probe: LaunchProbe | None

    @property
    def output(self) -> str: ...


def engine_stats(engine: ReportedEngine) -> dict[str, Any]:
    """Per-layer counters of ``engine`` by phase, their totals, link counters, the
    configuration and each running feature's section. Safe to call from another thread."""
    with engine.lock:
        layers = {name: la for name, la in engine.layers.items() if la.equipped}
        per_layer = {name: layer.stats for name, layer in layers.items()}
        total = LayerStats.sum(per_layer.values())
        first = next(iter(per_layer.values()), LayerStats())
        config, link = engine.config, engine.config.link
        return {
            "schema_version": STATS_SCHEMA_VERSION,
            "rank": engine.rank,
            "device": str(engine.device),
            "miss_policy": config.miss_policy,
            "predictor": config.predictor,
            "output": engine.output,
            "exact": engine.output == "exact",
            "config": config.to_dict(),
            "summary": summary(engine),
            "decode_tokens": first.decode.tokens,
            "prefill_tokens": first.prefill.tokens,
            "layer_index": {n: la.index for n, la in layers.items()},
            "slots_per_layer": {n: la.cache.num_slots for n, la in layers.items()},
            "region_rows_per_layer": {n: la.cache.pool.region_rows for n, la in layers.items()},
            "read_ahead_rows": read_ahead_rows(engine),
            "resident_per_layer": {n: la.cache.num_resident() for n, la in layers.items()},
            "experts_per_layer": {n: la.cache.num_experts for n, la in layers.items()},
            "expert_bytes": {n: la.cache.experts.expert_nbytes for n, la in layers.items()},
            "expert_format": {n: la.cache.experts.format for n, la in layers.items()},
            "slot_bytes": {n: la.cache.experts.slot_nbytes for n, la in layers.items()},
            "budget": budget_stats(engine.budget),
            "store_bytes": engine.store.nbytes,
            "pinned": engine.store.pin_memory,
            "modeled": {
                "bandwidth_gbps": link.bandwidth_gbps,
                "latency_us": link.latency_us,
                "host_slowdown": link.host_slowdown,
            }
            if link.emulated
            else None,
            "link": {
                "bytes": engine.link.bytes_copied,
                "copies": engine.link.copies,
                "stall_s": engine.link.stall_s,
            },
            **dict.fromkeys(slow_tiers.tier_names()),
            **{tier.name: tier.stats_dict() for tier in engine.store.tiers},
            "total": total.to_dict(),
            "layers": {name: s.to_dict() for name, s in per_layer.items()},
            **feature_stats(engine),
        }


def read_ahead_rows(engine: ReportedEngine) -> dict[str, Any] | None:
    """The shared region's rows a call needing every expert leaves for the following
    layer's reads ahead (``kept``), what the probe at start timed (``probe``: a launch of
    ``max_num_seqs`` tokens and reads beside it, from which ``disk.read_ahead_rows:
    "auto"`` keeps rows; ``None``: not probed), and how many a decode launch's compute
    would hide at the disk's rate as measured since (``hidden``: kernel seconds per
    decode launch times the disk's GB/s while busy, in experts; ``None`` before both are
    measured). ``None`` without a region."""
    with_region = [la for la in engine.layers.values() if la.equipped and la.cache.pool.region_rows]
    if not with_region:
        return None
    cache = with_region[0].cache
    kept = cache.pool.region_rows - (cache.num_experts - cache.num_slots)
    decode = LayerStats.sum(la.stats for la in with_region).decode
    disk = next((t.stats_dict() for t in engine.store.tiers if t.name == "disk"), {})
    rate = disk.get("busy_gbps", 0.0) * 1e9
    hidden = None
    if decode.kernel_calls and rate:
        launch_s = decode.kernel_s / decode.kernel_calls
        hidden = launch_s * rate / cache.experts.expert_nbytes
    probe = engine.launch_probe
    probed = None if probe is None else dataclasses.asdict(probe)
    return {"kept": kept, "probe": probed, "hidden": hidden}


def feature_stats(engine: ReportedEngine) -> dict[str, Any]:
    """Each running feature's stats section under its name; a feature that is off has
    none (read ``stats.get(name)``: ``None`` when off)."""
    sections: dict[str, Any] = {}
    for feature in engine.features:
        section = feature.stats()
        if section is not None:
            sections[feature.name] = section
    return sections


def feature_series(engine: ReportedEngine) -> list[dict[str, Any]]:
    """The running features' ``/metrics`` series (:class:`~vllm_specexpert.stats.Series`)
    and the counters they keep per layer, as the snapshot's JSON. Safe to call from
    another thread."""
    with engine.lock:
        series = [s for feature in engine.features for s in feature.series()]
        return [dataclasses.asdict(s) for s in series + part_series(engine)]


def part_series(engine: ReportedEngine) -> list[Series]:
    """Each counter the features keep per layer and phase (their places' among them,
    ``PhaseStats.parts``), served as the engine's own are (``specexpert_<key>_total``)."""
    families: dict[str, Series] = {}
    for layer in engine.layers.values():
        for phase in PHASES:
            for part in getattr(layer.stats, phase).parts.values():
                docs = part.docs()
                for key, value in part.counts().items():
                    family = families.get(key)
                    if family is None:
                        family = Series(metric_name(key), "counter", docs[key], ("layer", "phase"))
                        families[key] = family
                    family.add(value, layer.index, phase)
    return list(families.values())


def reset_counters(engine: ReportedEngine) -> None:
    """Every counter of ``engine`` at zero: its layers', link's, disk's and features'
    (each feature resets what it counts)."""
    with engine.lock:
        for layer in engine.layers.values():
            layer.reset_stats()
        for feature in engine.features:
            feature.reset_stats()
    engine.link.reset_counters()
    for tier in engine.store.tiers:
        tier.reset_stats()


def budget_stats(budget: BudgetPlan) -> dict[str, Any] | None:
    """What the budget came to (``None``: not sized from the memory), and the slots a
    layer a draft's rows are lent to until it drafts (the budget plan's ``lent``)."""
    plan = budget.current
    if plan is None or plan.fit is None:
        return None
    return {**plan.fit.to_dict(), "lent_slots_per_layer": plan.lent}


def summary(engine: ReportedEngine) -> str:
    """One line: MoE layers, slots per layer, slow tier, policy, predictor."""
    layers = [layer for layer in engine.layers.values() if layer.equipped]
    if not layers:
        return (
            f"{len(engine.layers)} MoE layers offloaded, their slots not made yet (no "
            "routed expert runs until they are)"
        )
    slots = sorted({layer.cache.num_slots for layer in layers})
    experts = sorted({layer.cache.num_experts for layer in layers})
    config = engine.config
    link = config.link
    modeled = (
        f", emulated link {link.bandwidth_gbps:g} GB/s + {link.latency_us:g} us/copy,"
        f" host_slowdown {link.host_slowdown:g}"
        if link.emulated
        else ""
    )
    residency = (
        f"{'/'.join(map(str, slots))} of {'/'.join(map(str, experts))} experts resident per layer"
    )
    first = next(iter(layers)).cache.experts
    moved = f"{first.format} experts of {first.expert_nbytes / 1e3:.1f} kB moved" + (
        f" into {first.slot_nbytes / 1e3:.1f} kB slots" if first.decoder else ""
    )
    if config.cache_spec.shared_pool:
        pools: dict[int, int] = {}
        for la in layers:
            pools[id(la.cache.pool)] = pools.get(id(la.cache.pool), 0) + la.cache.num_slots
        counts, each = "/".join(map(str, pools.values())), "/".join(map(str, experts))
        residency = (
            f"one pool of {counts} slots shared by their {each} experts each"
            if len(pools) == 1
            else f"{len(pools)} pools of {counts} slots, each shared by consecutive layers "
            f"of {each} experts (one pool would pass the expert kernel's reach)"
        )
    regions = {id(la.cache.pool.region): la.cache.pool.region_rows for la in layers}
    rows = [n for n in regions.values() if n]
    if rows:
        residency += (
            f", and one region of {'/'.join(map(str, rows))} rows every layer's slots "
            "cover (any layer's demand loads take them: a call's experts run in one "
            "launch, each read once)"
        )
        kept = read_ahead_rows(engine)
        if kept is not None and kept["kept"] > 0:
            residency += (
                f", {kept['kept']} more than a call needing every expert misses (the next "
                "layer's reads while a launch computes)"
            )
        reach = {la.cache.num_slots + la.cache.pool.region_rows for la in layers}
        if min(reach) < min(la.cache.num_experts for la in layers):
            residency += (
                f"; a call needing more than {'/'.join(map(str, sorted(reach)))} experts "
                "runs in token groups (the budget is too small for the rows to hold "
                "every expert a layer's own slots miss; a larger one reads each once)"
            )
    elif engine.region_refused is not None:
        residency += f" (no shared region: {engine.region_refused}; token groups)"
    fit = engine.budget.fit
    if fit is not None:
        residency += f", {gib(fit.slot_bytes)} ({fit.basis})"
    lent = engine.budget.current.lent if engine.budget.current is not None else 0
    if lent:
        residency += f"; {lent} slots a layer of them the draft's rows, lent until it first drafts"
    return (
        f"{len(engine.layers)} MoE layers offloaded, {residency}; {moved}; slow tier "
        f"{engine.store.nbytes / 1e9:.3f} GB {engine.store.where()}; "
        f"miss_policy {config.miss_policy} "
        f"({engine.output}), predictor {config.predictor}, cache {config.cache}"
        f"{modeled}{''.join(feature.summary() for feature in engine.features)}"
    )
