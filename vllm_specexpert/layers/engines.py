"""The offload engines of a worker process: one per vLLM model (config) built in it.

vLLM builds the ``lookahead`` draft (its layers named under
:data:`~vllm_specexpert.tiers.expert_pack.DRAFT_PREFIX`) right after its target, from a
config of its own: the draft's layers get an engine of their own (the draft's INT4
experts), attached to the target's engine, which receives its routes.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from vllm.platforms import current_platform

from vllm_specexpert import handoff
from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.handback import UnreadableRows
from vllm_specexpert.layers.sizing import sizing_settings
from vllm_specexpert.tiers import slow_tiers

_ENGINES: dict[int, tuple[weakref.ref, OffloadEngine]] = {}
"""One engine per live vLLM config (one per worker process, unless several engines run
in one process). Keyed by ``id`` and checked by weak reference, since ids are reused."""


_TARGETS: weakref.WeakKeyDictionary[OffloadEngine, OffloadEngine] = weakref.WeakKeyDictionary()
"""A draft's engine -> its target's."""

_TARGET: weakref.ref | None = None
"""The engine of the last target model built in this process: vLLM builds the draft
(``lookahead``) right after its target, and the draft's engine hands it its routes."""


def engine_for(vllm_config: Any, config: SpecExpertConfig, draft: bool = False) -> OffloadEngine:
    """The engine of ``vllm_config``'s model; a draft model's engine (``draft``: its
    ``config`` is the draft's, :meth:`SpecExpertConfig.draft_config`) runs the draft's
    INT4 experts and is attached to its target's engine."""
    global _TARGET
    existing = engine_of(vllm_config)
    if existing is not None:
        return existing
    device = torch.device(current_platform.device_type)
    rank = vllm_config.parallel_config.rank
    if draft:
        target = current_target()
        if target is None or target.config.lookahead is None:
            raise RuntimeError(
                "specexpert: a draft model was built without a target "
                "engine configured for lookahead"
            )
        engine = OffloadEngine(
            config,
            device,
            rank=rank,
            reports=False,
            budget_field="lookahead.draft_budget",
            splits_slots=False,  # (its slots are sized with the target's)
            # (its rows are the target's slots until it drafts: lookahead_driver)
            slots_deferred=target.budget.rows_lent,
        )
        engine.unreadable = UnreadableRows(draft=True)
        _TARGETS[engine] = target
        target.provide(draft=engine)  # its routes become the target's lookahead
    else:
        engine = OffloadEngine(config, device, rank=rank)
        tier = slow_tiers.open_tier(config, vllm_config.model_config.model)
        if tier is not None:
            engine.store.tiers.append(tier)
        _TARGET = weakref.ref(engine)
    engine.budget.sizing = sizing_settings(vllm_config)
    engine.provide(step_demand=handoff.current)  # the scheduler's, handed to each step
    key = id(vllm_config)

    def forget(_ref: weakref.ref) -> None:
        _ENGINES.pop(key, None)
        engine.close()

    _ENGINES[key] = (weakref.ref(vllm_config, forget), engine)
    return engine


def engine_of(vllm_config: Any) -> OffloadEngine | None:
    """The engine built for ``vllm_config`` in this process, if any."""
    entry = _ENGINES.get(id(vllm_config))
    return entry[1] if entry is not None and entry[0]() is vllm_config else None


def current_target() -> OffloadEngine | None:
    """The target engine built last in this process (a draft is built after it)."""
    return _TARGET() if _TARGET is not None else None


def target_of(draft: OffloadEngine) -> OffloadEngine:
    """The target engine whose lookahead the ``draft`` engine's routes are."""
    return _TARGETS[draft]
