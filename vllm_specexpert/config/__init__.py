"""SpecExpertConfig: every knob of the plugin, its default, its range, and its validation.

Users set it through vLLM's ``additional_config={"specexpert": {...}}`` (CLI:
``--additional-config '{"specexpert": {...}}'``). The classes are pydantic dataclasses
(vLLM's config idiom): types, ranges (in each field's docstring), finiteness and unknown
keys are checked by pydantic when :meth:`SpecExpertConfig.from_dict` builds one at engine
start (:mod:`.specexpert`, :mod:`.sections`). On top of that, two rules
(:mod:`.rules`), which read the modes' traits (:mod:`.modes`):

- **A setting must do something under the chosen mode.** A key the user sets that only
  tunes a mode which is off (``buddy`` under ``fetch``, ``link.latency_us`` without an
  emulated link, ``exact_layers`` without ``speculate``, ...) is an error naming what it
  needs. Artifacts (``calibration``, ``path_predictor``) are exempt: they are loaded and
  checked whatever the mode, and ``reconfigure`` may switch to a mode that uses them.
- **What depends on the model** (the budget against top_k and the experts per layer,
  ``exact_layers`` against the MoE layers, artifacts against the model's shapes) is
  checked when the engine knows the model, still before serving.

Every error is a :class:`SpecExpertConfigError` that names the field and the fix
(:mod:`.errors`).
"""

from vllm_specexpert.config.budget_form import MAX_EXPERTS
from vllm_specexpert.config.errors import (
    ADDITIONAL_CONFIG_KEY,
    SpecExpertConfigError,
    SpecExpertUnsupportedError,
)
from vllm_specexpert.config.modes import CACHES, MISS_POLICIES, PREDICTORS
from vllm_specexpert.config.sections import (
    BuddyConfig,
    LinkConfig,
    LookaheadConfig,
    TokenSchedulerConfig,
)
from vllm_specexpert.config.specexpert import SpecExpertConfig
from vllm_specexpert.config.switch import check_switch

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "CACHES",
    "MAX_EXPERTS",
    "MISS_POLICIES",
    "PREDICTORS",
    "BuddyConfig",
    "LinkConfig",
    "LookaheadConfig",
    "SpecExpertConfig",
    "SpecExpertConfigError",
    "SpecExpertUnsupportedError",
    "TokenSchedulerConfig",
    "check_switch",
]
