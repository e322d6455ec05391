"""Which features compose: every pair of settings either runs, with its output label, or is
refused at start with its reason.

    specexpert composition [--out docs/composition.md]

A pair is two non-default values of two dimensions (:data:`DIMENSIONS`: the miss policy,
the cache, the predictor, the lookahead draft, the token scheduler, the mesh, the
quality budget, a quantized checkpoint, the disk tier). Each is completed with what it
needs and nothing else (:func:`settings`: a predictor for ``speculate``, a calibration
for ``buddy``, a path predictor for ``plec``, an approximate policy under ``quality``,
...), then checked as
the engine's start checks it: the config's rules, and what it needs of the model
(:meth:`~vllm_specexpert.config.SpecExpertConfig.check_fits`, on a model of
:data:`MODEL_EXPERTS` experts, top-:data:`MODEL_TOP_K`). ``tests/test_composition.py``
runs every pair the engine can run without vLLM and checks its label, and checks that
the table in ``docs/composition.md`` is this module's.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.config.modes import CACHES, MISS_POLICIES, PREDICTORS

MODEL_EXPERTS, MODEL_TOP_K = 16, 2
"""The routing shape the pairs are checked on (the test's toy model)."""

DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "miss_policy": tuple(MISS_POLICIES),
    "cache": ("lrfu", "lru", "lfu", "static", "markov", "plec"),
    "predictor": ("none", "router", "quasi_hidden", "estimator", "hybrid"),
    "lookahead": (None, "on"),
    "token_scheduler": (None, "on"),
    "mesh": (None, "sync", "early_fire", "no_stop"),
    "quality": (None, "on"),
    "checkpoint": ("bf16", "awq"),
    "disk": (None, "slots", "mapped"),
}
"""Each dimension's values, the default first."""

ARTIFACTS = {
    "calibration": "CALIBRATION",
    "estimator": "ESTIMATOR",
    "analysis": "ANALYSIS",
    "path_predictor": "PATH_PREDICTOR",
}
"""Placeholders of the artifact directories (the start checks read them; the config
does not)."""


@dataclass(frozen=True)
class Setting:
    dimension: str
    value: Any

    def __str__(self) -> str:
        return f"{self.dimension}={self.value}" if self.value != "on" else self.dimension


@dataclass(frozen=True)
class Verdict:
    """What the engine's start says of a pair."""

    runs: bool
    output: str | None = None
    """``exact``, ``equivalent`` or ``approximate`` (when it runs)."""
    field: str | None = None
    """The field its refusal names."""
    reason: str | None = None

    def cell(self) -> str:
        return self.output if self.runs else f"refused: `{self.field}`: {self.reason}"


def features() -> list[Setting]:
    """Every non-default value of every dimension."""
    return [Setting(d, v) for d, values in DIMENSIONS.items() for v in values[1:]]


def pairs() -> list[tuple[Setting, Setting]]:
    """Every two non-default values of two dimensions."""
    return [(a, b) for a, b in itertools.combinations(features(), 2) if a.dimension != b.dimension]


def settings(*chosen: Setting) -> tuple[dict[str, Any], str | None]:
    """The ``specexpert`` config of ``chosen``, completed with what each needs, and the
    checkpoint's packed format (``None``: bf16)."""
    given = {s.dimension: s.value for s in chosen}
    raw: dict[str, Any] = {"budget": 0.25}
    packed = "awq" if given.get("checkpoint") == "awq" else None
    for key in ("miss_policy", "cache", "predictor"):
        if key in given:
            raw[key] = given[key]
    if "lookahead" in given:
        raw["lookahead"] = {}
    if "token_scheduler" in given:
        raw["token_scheduler"] = {}
    if "mesh" in given:
        raw["mesh"] = {"mode": given["mesh"]}
    if "disk" in given:
        raw["disk"] = {"path": "PACK", "residency": given["disk"]}
        if given["disk"] == "mapped":
            del raw["budget"]  # (the page cache is the cache: no slot to size)
    if "quality" in given:
        raw["quality"] = {}
        raw.setdefault("miss_policy", "drop")  # a mode that changes the output
    policy = MISS_POLICIES[raw.get("miss_policy", "fetch")]
    predictor = PREDICTORS[raw.get("predictor", "none")]
    speculative_mesh = given.get("mesh") in ("early_fire", "no_stop")
    if (policy.needs_predictor or speculative_mesh) and not predictor.predicts:
        raw.setdefault("predictor", "router")
        predictor = PREDICTORS[raw["predictor"]]
    # Substitution reads the calibration's co-activation and TAE percentiles (the
    # default buddy.tau is a percentile).
    if predictor.needs_calibration or policy.substitutes:
        raw["calibration"] = ARTIFACTS["calibration"]
    if predictor.needs_estimator:
        raw["estimator"] = ARTIFACTS["estimator"]
    if predictor.needs_analysis:
        raw["analysis"] = ARTIFACTS["analysis"]
    if "token_scheduler" in given or (
        CACHES[raw.get("cache", "lrfu")].needs_path_predictor and "lookahead" not in given
    ):
        raw["path_predictor"] = ARTIFACTS["path_predictor"]
    return raw, packed


def verdict(*chosen: Setting) -> Verdict:
    """What the engine's start checks say of ``chosen`` (module doc)."""
    raw, packed = settings(*chosen)
    try:
        config = SpecExpertConfig.from_dict(raw)
        config.check_fits(MODEL_EXPERTS, MODEL_TOP_K, packed)
    except SpecExpertConfigError as error:
        return Verdict(False, field=error.field_name, reason=error.problem)
    return Verdict(True, output=config.output)


def table() -> str:
    """The Markdown of every pair's verdict, grouped by the first setting."""
    lines = ["| first | second | verdict |", "|---|---|---|"]
    for a, b in pairs():
        lines.append(f"| {a} | {b} | {verdict(a, b).cell()} |")
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- composition table: begin -->", "<!-- composition table: end -->"
"""Where ``docs/composition.md`` holds the generated table."""


def with_table(document: str) -> str:
    """``document`` with the text between :data:`BEGIN` and :data:`END` replaced by
    :func:`table`."""
    head, _, rest = document.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{table()}{END}{tail}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("docs/composition.md"),
        help="the document whose table is rewritten (between its markers)",
    )


def run(args: argparse.Namespace) -> None:
    document = args.out.read_text() if args.out.exists() else f"{BEGIN}\n{END}\n"
    args.out.write_text(with_table(document))
    refused = sum(not verdict(a, b).runs for a, b in pairs())
    print(f"{len(pairs())} pairs, {refused} refused -> {args.out}")
