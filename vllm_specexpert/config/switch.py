"""What a running engine's config can switch to (``reconfigure``): the settings read when
the engine starts stay as they were."""

from __future__ import annotations

from typing import Any

from vllm_specexpert.config.errors import SpecExpertConfigError
from vllm_specexpert.config.sections import SETTINGS_READ_AT_START
from vllm_specexpert.config.specexpert import SpecExpertConfig

READ_AT_START = (
    "calibration",
    "estimator",
    "analysis",
    "hybrid_threshold",
    "path_predictor",
    "token_scheduler",
)
"""Artifacts and settings read once, when the engine starts."""


def check_switch(current: SpecExpertConfig, config: SpecExpertConfig) -> None:
    """Raise a config error unless a running engine can switch from ``current`` to
    ``config`` without starting again."""
    for name in READ_AT_START:
        if getattr(config, name) != getattr(current, name):
            raise SpecExpertConfigError(
                name,
                "is read when the engine starts and cannot change at run time",
                f"start a new engine with the new '{name}'",
            )
    if _changed_at_start(current.disk, config.disk, "disk"):
        raise SpecExpertConfigError(
            "disk",
            "the pack is opened and checked when the engine starts; only "
            "disk.read_ahead_rows can change at run time",
            "start a new engine with the new 'disk'",
        )
    if _changed_at_start(current.mesh, config.mesh, "mesh"):
        raise SpecExpertConfigError(
            "mesh",
            "its peers and their shards are made when the engine starts; only "
            "mesh.mode, rtt_cap_ms, timeout_ms and probe_interval_s can change at run time",
            "start a new engine with the new 'mesh'",
        )
    if _changed_at_start(current.lookahead, config.lookahead, "lookahead"):
        raise SpecExpertConfigError(
            "lookahead",
            "is read when the engine starts (vLLM's speculative decoding and "
            "the draft are built then); only lookahead.k can change at run time",
            "start a new engine with the new 'lookahead'",
        )


def _changed_at_start(before: Any, after: Any, section: str) -> bool:
    """Whether the section was turned on or off, or a setting of it read at start
    changed."""
    if before is None or after is None:
        return (before is None) != (after is None)
    names = SETTINGS_READ_AT_START[section]
    return any(getattr(before, name) != getattr(after, name) for name in names)
