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

from vllm_specexpert.config import SpecExpertConfigError

ANALYSIS_FILE = "analysis.json"
FIX = ("run `specexpert analyze MODEL --calibration DIR --out ADIR` for this model and "
       "set \"analysis\": \"ADIR\"")


def read_analysis(path: str | Path, model: str | None = None, hf_config=None) -> dict:
    """``analysis.json`` of ``path``, checked: it has ``quasi_hidden``'s recall per
    transition, made for ``model`` if given (one config error naming ``analysis``)."""
    from vllm_specexpert.artifacts import check_matches_model

    file = Path(path) / ANALYSIS_FILE
    try:
        analysis = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise SpecExpertConfigError("analysis", f"{file}: unreadable ({exc})", FIX) from None
    if not isinstance(analysis, dict) or "quasi_hidden" not in analysis.get("predictors", ()):
        raise SpecExpertConfigError(
            "analysis", f"{file} has no quasi_hidden recall (analyze ran without "
            "--calibration)", FIX)
    if "model_fingerprint" not in analysis:
        raise SpecExpertConfigError(
            "analysis", f"{file} does not say which model it measured (made by an older "
            "version)", FIX)
    if model is not None:
        check_matches_model(analysis, model, hf_config, field="analysis", fix=FIX)
    return analysis


def hybrid_layers(analysis: dict, threshold: float | None) -> tuple[list[int], float]:
    """The decoder indices of the layers l after which the estimator runs (those whose
    transition l -> l+1 has ``quasi_hidden`` recall below ``threshold``), and the
    threshold used (``None``: the mean recall)."""
    recall = {row["from_layer"]: row["quasi_hidden"]["recall"]
              for row in analysis["transitions"]}
    if threshold is None:
        threshold = sum(recall.values()) / max(len(recall), 1)
    return sorted(layer for layer, r in recall.items() if r < threshold), threshold


def check_layers(analysis: dict, layers: list[int]) -> None:
    """The analysis measured the transitions of these MoE ``layers`` (decoder indices)."""
    measured = [(row["from_layer"], row["to_layer"]) for row in analysis["transitions"]]
    if measured != list(pairwise(layers)):
        raise SpecExpertConfigError(
            "analysis", f"measured the transitions {measured}, and the offloaded MoE "
            f"layers are {layers}", FIX)
