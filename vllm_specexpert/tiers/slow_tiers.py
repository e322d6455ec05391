"""The slow tiers a store's layers can be read from besides the host's tensors (which
vLLM loads), behind one registry, as places are: the tier a config turns on serves every
layer's experts, and vLLM loads none of them.

Adding a slow tier is a module under ``tiers/`` that ends with ``SLOW_TIER = TheClass``
(a :class:`SlowTierClass`), its line in :data:`REGISTRY` and its word in the package's
map. Its stats section in the engine's stats is its :attr:`~SlowTier.name`."""

from __future__ import annotations

import importlib
from typing import ClassVar, Protocol

from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.tiers.store import SlowTier

REGISTRY = ("disk",)
"""The slow tiers' modules under ``tiers/``: the first that a config turns on serves."""


class SlowTierClass(Protocol):
    name: ClassVar[str]

    @classmethod
    def configured(cls, config: SpecExpertConfig, model: str) -> bool:
        """Whether ``config`` turns this tier on for ``model`` (its experts are then not
        loaded by vLLM)."""
        ...

    @classmethod
    def open(cls, config: SpecExpertConfig, model: str) -> SlowTier:
        """The tier, open; called only where :meth:`configured`."""
        ...


def tier_classes() -> list[SlowTierClass]:
    """The registered slow tiers' classes, in order."""
    return [importlib.import_module(f"{__package__}.{name}").SLOW_TIER for name in REGISTRY]


def tier_names() -> list[str]:
    """Their stats sections."""
    return [cls.name for cls in tier_classes()]


def configured(config: SpecExpertConfig, model: str) -> SlowTierClass | None:
    """The slow tier ``config`` turns on for ``model``, if any."""
    return next((cls for cls in tier_classes() if cls.configured(config, model)), None)


def open_tier(config: SpecExpertConfig, model: str) -> SlowTier | None:
    """The slow tier ``config`` turns on for ``model``, open; ``None``: the host's."""
    cls = configured(config, model)
    return cls.open(config, model) if cls is not None else None
