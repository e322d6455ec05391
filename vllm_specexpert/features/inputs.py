"""What the vLLM adapter hands an engine as it wires the model, for the features built
from it (:func:`vllm_specexpert.features.build`), and the checks that need them. Given
with :meth:`OffloadEngine.provide <vllm_specexpert.engine.OffloadEngine.provide>`: the
engine keeps them without reading any."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.layer_state import OffloadedLayer, check_change, check_runnable
from vllm_specexpert.predict import PredictorInputs
from vllm_specexpert.quality import LogitHead
from vllm_specexpert.tiers.peer import PeerTier


@dataclass
class FeatureInputs:
    predictor_inputs: PredictorInputs = field(default_factory=PredictorInputs)
    """The artifacts' inputs of the predictors (calibration, estimator)."""
    logit_head: LogitHead | None = None
    """The model's final norm and LM head (``quality`` compares logits with them)."""
    peer_tier: PeerTier | None = None
    """The mesh's peers (``mesh``)."""
    hot_experts: dict[int, np.ndarray] = field(default_factory=dict)
    """Per layer index: experts pinned in the device cache instead of asked of peers
    (``mesh.placement: replicate_hot``)."""
    draft: Any = None
    """The lookahead draft's engine (``lookahead``), once vLLM has built the draft."""


def check_start(
    config: SpecExpertConfig, layers: Iterable[OffloadedLayer], inputs: FeatureInputs
) -> None:
    """Raise a config error if ``config`` cannot run on the loaded ``layers`` with
    ``inputs`` (at engine start: never mid-generation)."""
    check_runnable(config, layers, inputs.predictor_inputs)


def check_reconfigure(
    current: SpecExpertConfig,
    config: SpecExpertConfig,
    layers: Iterable[OffloadedLayer],
    inputs: FeatureInputs,
) -> None:
    """Raise a config error unless the running engine can switch from ``current`` to
    ``config`` with the ``inputs`` it was given."""
    check_change(current, config, layers, inputs.predictor_inputs)
    if config.quality is not None and inputs.logit_head is None:
        raise SpecExpertConfigError(
            "quality",
            "its monitor reads the model's final norm through a tap "
            "installed when an engine starts with a quality budget",
            "start the engine with 'quality' set (then it can change, or be turned off and on)",
        )
