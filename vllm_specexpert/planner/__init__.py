"""Planners: which experts to load ahead of demand, and when. :mod:`.prefetch` turns a
next-layer prediction into a prefetch (what pays for its link time); :mod:`.plec` plans a
shared slot pool by the step's predicted demand (ExpertFlow's PLEC). They decide and
submit loads; the layer call itself is run by :mod:`vllm_specexpert.execute`."""

from __future__ import annotations

from typing import Protocol

from vllm_specexpert.stats import LayerStats
from vllm_specexpert.tiers.cache import ExpertCache
from vllm_specexpert.tiers.loader import ExpertLoader


class PlannedLayer(Protocol):
    """What a planner uses of an offloaded MoE layer."""

    index: int
    """Decoder-layer index (the key of a step's predicted demand)."""
    cache: ExpertCache
    loader: ExpertLoader
    stats: LayerStats
