"""``get_stats`` says its schema version (issue 46): each worker's dict, as its RPC
returns it and as ``stats_path`` writes it, carries ``schema_version``; the version in
force has its line in ``docs/changelog.md``. On a toy engine, without vLLM."""

import json
import re
from pathlib import Path

from moe_reference import random_layer

from vllm_specexpert.report import STATS_SCHEMA_VERSION
from vllm_specexpert.worker import SpecExpertWorkerExtension

CHANGELOG = Path(__file__).resolve().parent.parent / "docs" / "changelog.md"
NAME = "model.layers.0.mlp.experts"


def test_each_workers_stats_carry_the_schema_version(toy_engines, tmp_path):
    stats_file = tmp_path / "stats.json"
    engine = toy_engines(
        {"budget": 0.25, "stats_path": str(stats_file)}, {NAME: random_layer(seed=0)}, top_k=4
    )

    class Worker(SpecExpertWorkerExtension):  # a vLLM worker whose model holds ``engine``
        def _specexpert_engine(self):
            return engine

    stats = Worker().specexpert_stats()  # what get_stats(llm) calls on every worker
    assert stats["schema_version"] == 6
    assert type(stats["schema_version"]) is int
    assert json.loads(stats_file.read_text())["schema_version"] == 6
    # The type change version 2 was numbered for: a per-layer dict, not an int.
    assert stats["slots_per_layer"] == {NAME: 4}
    # The change version 3 was numbered for: a feature that is off has no section.
    assert not {"lookahead", "mesh", "quality"} & set(stats)
    # The change of version 5: under fetch no place but `dropped` has counters.
    decode = stats["total"]["decode"]
    assert decode["dropped_entries"] == 0
    assert not {"host_entries", "substituted_entries", "low_bit_entries", "peer_entries"} & set(
        decode
    )
    # The change of version 6: with no predictor, no prediction counters.
    assert not {"predicted", "recall", "speculated_calls", "path_needed"} & set(decode)


def test_the_version_in_force_has_its_line_in_the_changelog():
    text = CHANGELOG.read_text()
    section = text.split("## get_stats schema", 1)[1].split("\n## ", 1)[0]
    versions = [int(v) for v in re.findall(r"^- \*\*(\d+)\*\*", section, flags=re.M)]
    assert versions and max(versions) == STATS_SCHEMA_VERSION
