"""What a running engine's config can switch to (``reconfigure``): the settings read when
the engine starts stay as they were."""

from __future__ import annotations

from vllm_specexpert.config.errors import SpecExpertConfigError
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
    if config.disk != current.disk:
        raise SpecExpertConfigError(
            "disk",
            "the pack is opened and checked when the engine starts",
            "start a new engine with the new 'disk'",
        )
    before, after = current.mesh, config.mesh
    if (before is None) != (after is None) or (
        before is not None
        and after is not None
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
        and (drafts[0].k_max, drafts[0].draft_budget, drafts[0].draft_cache)
        != (drafts[1].k_max, drafts[1].draft_budget, drafts[1].draft_cache)
    ):
        raise SpecExpertConfigError(
            "lookahead",
            "is read when the engine starts (vLLM's speculative decoding and "
            "the draft are built then); only lookahead.k can change at run time",
            "start a new engine with the new 'lookahead'",
        )
