"""Hybrid-PF's layer choice (speculating-experts §6.2): the neural estimator only after
the layers whose next layer the parameter-free ``quasi_hidden`` predicts badly.

"Badly" is measured offline by ``specexpert analyze`` (``analysis.json``: recall@k of
every predictor per layer transition, on held-out text): a transition whose
``quasi_hidden`` recall is below ``hybrid_threshold`` (default: the mean over the
model's transitions) uses the estimator.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, Field, Strict, ValidationInfo, field_validator

from vllm_specexpert.artifacts import (
    MANIFEST,
    ExpertCount,
    LayerIndex,
    MadeForModel,
    ModelFingerprint,
    Str,
    TopK,
    check_matches_model,
    parse_manifest,
)
from vllm_specexpert.config import SpecExpertConfigError

ANALYSIS_FILE = "analysis.json"
FIX = (
    "run `specexpert analyze MODEL --calibration DIR --out ADIR` for this model and "
    'set "analysis": "ADIR"'
)

Recall = Annotated[float, Strict(), Field(ge=0, le=1)]


class Score(BaseModel):
    """One predictor's measurement of one transition (``recall`` is what ``hybrid``
    reads; ``cosine``, ``rank_alignment``... are information)."""

    model_config = MANIFEST

    recall: Recall


class Transition(BaseModel):
    """One row of ``transitions``: layer ``from_layer`` -> ``to_layer`` and a
    :class:`Score` per predictor measured (``quasi_hidden`` required)."""

    model_config = MANIFEST

    from_layer: LayerIndex
    to_layer: LayerIndex
    quasi_hidden: Score


class Analysis(MadeForModel):
    """``analysis.json`` as ``specexpert analyze --calibration`` writes it."""

    model_fingerprint: ModelFingerprint
    predictors: list[Str]
    transitions: Annotated[list[Transition], Field(min_length=1)]
    top_k: TopK | None = None
    num_experts: ExpertCount | None = None
    tokens: Annotated[int, Strict(), Field(ge=0)] | None = None

    @field_validator("predictors")
    @classmethod
    def _with_quasi_hidden(cls, predictors: list[str]) -> list[str]:
        if "quasi_hidden" not in predictors:
            raise ValueError(
                f"{predictors} has no quasi_hidden (analyze ran without --calibration)"
            )
        return predictors

    @field_validator("transitions")
    @classmethod
    def _consecutive(cls, transitions: list[Transition]) -> list[Transition]:
        # hybrid_layers keys its choice by from_layer: each MoE layer once, in order.
        rows = [(row.from_layer, row.to_layer) for row in transitions]
        if any(a >= b for a, b in rows) or any(b != c for (_, b), (c, _) in pairwise(rows)):
            raise ValueError(f"{rows} are not transitions between consecutive layers")
        return transitions

    @field_validator("top_k", "num_experts")
    @classmethod
    def _the_fingerprints(cls, value: int | None, info: ValidationInfo) -> int | None:
        fingerprint = info.data.get("model_fingerprint")
        assert info.field_name is not None  # a field validator's info names its field
        differs = fingerprint and fingerprint.disagreement(**{info.field_name: value})
        if differs:
            raise ValueError(differs)
        return value


def read_analysis(
    path: str | Path, model: str | None = None, hf_config: object | None = None
) -> dict:
    """``analysis.json`` of ``path``, validated (and checked against ``model``); errors
    name ``analysis``."""
    file = Path(path) / ANALYSIS_FILE
    try:
        analysis = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise SpecExpertConfigError("analysis", f"{file}: unreadable ({exc})", FIX) from None
    checked = parse_manifest(Analysis, analysis, "analysis", file, FIX)
    if model is not None:
        check_matches_model(checked, model, hf_config, field="analysis", fix=FIX)
    return analysis


def hybrid_layers(analysis: dict, threshold: float | None) -> tuple[list[int], float]:
    """Decoder indices of the layers whose transition's ``quasi_hidden`` recall is below
    ``threshold`` (``None``: the mean), and the threshold used."""
    recall = {row["from_layer"]: row["quasi_hidden"]["recall"] for row in analysis["transitions"]}
    if threshold is None:
        threshold = sum(recall.values()) / max(len(recall), 1)
    return sorted(layer for layer, r in recall.items() if r < threshold), threshold


def check_layers(analysis: dict, layers: list[int]) -> None:
    """The analysis measured the transitions of these MoE ``layers`` (decoder indices)."""
    measured = [(row["from_layer"], row["to_layer"]) for row in analysis["transitions"]]
    if measured != list(pairwise(layers)):
        raise SpecExpertConfigError(
            "analysis",
            f"measured the transitions {measured}, and the offloaded MoE layers are {layers}",
            FIX,
        )
