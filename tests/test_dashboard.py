"""The Grafana dashboard (``docs/grafana/specexpert.json``) asks only for series that
``/metrics`` exposes: the names come from the plugin's own collector
(:class:`vllm_specexpert.metrics.SnapshotCollector`), rendered by prometheus_client as a
scrape renders them, not from a list kept by hand."""

import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from moe_reference import random_layer, random_routing, slot_kernel
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_specexpert import metrics
from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.features.low_bit import LOW_BIT_SUFFIX
from vllm_specexpert.features.mesh import PEER_COUNTERS
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.quality import LogitHead

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "specexpert.json"
SERIES = re.compile(r"\b" + metrics.PREFIX + r"[a-zA-Z0-9_:]*")
SUFFIXES = {
    # The sample names of a family of each type, as the text exposition writes them.
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


def scrape_text(directory: Path) -> str:
    registry = CollectorRegistry()
    registry.register(metrics.SnapshotCollector(str(directory)))
    return generate_latest(registry).decode()


class StandInPeers:
    """What the mesh feature reads of a peer tier: one peer, in rotation."""

    def __init__(self) -> None:
        self.mesh = None
        self.peers = [SimpleNamespace(up=True)]

    def hosted(self, layer: int) -> np.ndarray:
        return np.zeros(16, dtype=bool)

    def stats(self) -> dict:
        return {
            "peers": [{"rank": 0, "up": True, "rtt_ms": 1.0, **dict.fromkeys(PEER_COUNTERS, 0)}]
        }

    def close(self) -> None:
        pass


NAME = "model.layers.0.mlp.experts"


def int4_copies(engine: OffloadEngine) -> None:
    """Stand-ins for the INT4 copies the adapter adds beside the layer under ``lowbit``
    (their form does not matter to the series)."""
    engine.store.add_layer(NAME + LOW_BIT_SUFFIX, random_layer(seed=1))


ENGINES = {
    # A feature's families (and its place's) are on /metrics only while it runs: one
    # engine per feature that has some (lookahead and mesh do not run together; an
    # approximate mode without the model's logit head here runs with quality null).
    "plain": ({"budget": 0.25}, dict),
    "prediction": ({"budget": 0.25, "predictor": "router"}, dict),
    "host": ({"budget": 0.25, "miss_policy": "cpu"}, dict),
    "substitution": (
        {"budget": 0.25, "miss_policy": "random", "buddy": {"tau": 0.5}, "quality": None},
        dict,
    ),
    "low_bit": ({"budget": 0.5, "miss_policy": "lowbit", "quality": None}, dict, int4_copies),
    "lookahead": ({"budget": 0.25, "lookahead": {}}, dict),
    "mesh": ({"budget": 0.25, "mesh": {}}, lambda: {"peer_tier": StandInPeers()}),
    "quality": (
        {"budget": 0.25, "miss_policy": "drop", "quality": {}},
        lambda: {
            "logit_head": LogitHead(
                norm_weight=torch.ones(32), eps=1e-6, weight=torch.eye(32), vocab_size=32
            )
        },
    ),
}


def scraped(
    directory: Path,
    config: dict,
    inputs: dict,
    model_name: str = "tiny",
    after_call=lambda engine: None,
    prepare=lambda engine: None,
) -> str:
    """The scrape of an engine under ``config`` with ``inputs`` (and what ``prepare``
    adds before its layer) after one decode call and ``after_call(engine)``."""
    name = NAME
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(metrics.DIRECTORY_ENV, str(directory))
        patch.setenv(metrics.MODEL_NAME_ENV, model_name)
        engine = OffloadEngine(SpecExpertConfig.from_dict(config), torch.device("cpu"))
        try:
            prepare(engine)
            engine.add_layer(name, random_layer(seed=0), top_k=4, index=0, host_kernel=slot_kernel)
            engine.provide(**inputs)
            engine.start()
            x, w, ids = random_routing(4, 16, 4, seed=0)
            engine.run_call(LayerCall(name, slot_kernel, x, w, ids))
            after_call(engine)
            engine.write_stats()
            return scrape_text(directory)
        finally:
            engine.close()


@pytest.fixture(scope="module")
def exposed(tmp_path_factory) -> set[str]:
    """Every sample name the collector can expose: each family it yields for an engine
    without features and for one with each feature that supplies series (those it fills,
    and those it yields empty), with the suffixes of its type. Checked against the
    samples the engines' snapshots give."""
    names: set[str] = set()
    samples: set[str] = set()
    for what, (config, inputs, *prepare) in ENGINES.items():
        text = scraped(
            tmp_path_factory.mktemp(what),
            config,
            inputs(),
            prepare=prepare[0] if prepare else lambda engine: None,
        )
        for family in text_string_to_metric_families(text):
            assert family.type in SUFFIXES, f"{family.name}: a {family.type}; add its suffixes"
            names.update(family.name + suffix for suffix in SUFFIXES[family.type])
            samples.update(sample.name for sample in family.samples)
    assert "specexpert_hits_total" in samples  # the engine's snapshot was scraped
    for feature in ("lookahead_drafted_tokens_total", "peer_up", "quality_exact"):
        assert metrics.PREFIX + feature in samples  # and each feature's
    assert samples <= names, samples - names  # the suffixes are the exposition's
    return names


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(container: dict) -> Iterator[dict]:
    """Every panel, rows' nested panels included; rows themselves are not panels."""
    for panel in container.get("panels", []):
        if panel.get("type") != "row":
            yield panel
        yield from panels(panel)


def queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    board = dashboard()
    for panel in panels(board):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} target {target.get('refId')}", target.get("expr", "")
    for variable in board.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            yield (
                f"variable {variable['name']}",
                (query["query"] if isinstance(query, dict) else query),
            )


def test_every_query_names_only_series_that_metrics_exposes(exposed):
    named = {where: set(SERIES.findall(expr)) for where, expr in queries()}
    assert named  # the dashboard has queries to check
    nameless = [where for where, series in named.items() if not series]
    assert nameless == []  # a query of no specexpert_ series checks nothing here
    unknown = {where: sorted(series - exposed) for where, series in named.items()}
    assert {where: series for where, series in unknown.items() if series} == {}


def test_every_panel_has_a_target_on_the_dashboards_datasource():
    board = dashboard()
    assert [i["name"] for i in board["__inputs"]] == ["DS_PROMETHEUS"]
    datasource = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    found = list(panels(board))
    assert found
    assert [p["title"] for p in found if not p.get("targets")] == []
    assert [p["title"] for p in found if p.get("datasource") != datasource] == []
    assert [
        (p["title"], t.get("refId"))
        for p in found
        for t in p["targets"]
        if t.get("datasource") != datasource or not t.get("expr", "").strip()
    ] == []
    ids = [p["id"] for p in board["panels"]] + [p["id"] for p in found if p not in board["panels"]]
    assert len(ids) == len(set(ids))  # Grafana keys panels by id
