"""vllm-specexpert: MoE inference with experts in a slow tier and a device expert cache.

Enable with ``VLLM_PLUGINS=specexpert`` (or no VLLM_PLUGINS at all) and
``additional_config={"specexpert": {...}}``; see :class:`SpecExpertConfig`.
"""

from __future__ import annotations

from typing import Any

from vllm_specexpert.config import (
    LinkConfig,
    SpecExpertConfig,
    SpecExpertConfigError,
    SpecExpertUnsupportedError,
)

__version__ = "0.1.0"


def get_stats(llm: Any) -> list[dict[str, Any]]:
    """Per-worker statistics of an ``LLM`` running with the plugin (one dict per worker)."""
    return llm.collective_rpc("specexpert_stats")


def reconfigure(llm: Any, **changes: Any) -> dict[str, Any]:
    """Change the running engine's config, e.g. ``reconfigure(llm, budget=0.25)``.
    Caches are rebuilt without reloading weights; counters restart. Returns the config."""
    return llm.collective_rpc("specexpert_reconfigure", args=(changes,))[0]


def reset_stats(llm: Any) -> None:
    """Zero the counters of every worker."""
    llm.collective_rpc("specexpert_reset_stats")


__all__ = [
    "LinkConfig",
    "SpecExpertConfig",
    "SpecExpertConfigError",
    "SpecExpertUnsupportedError",
    "get_stats",
    "reconfigure",
    "reset_stats",
]
