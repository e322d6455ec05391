"""Prometheus series from the workers' snapshots (:mod:`vllm_specexpert.metrics`), without
a server: an engine writes its snapshot, the collector turns it into ``specexpert_*``
series; a feature's series are its own, served as given. The scrape of a real server
after traffic is in ``test_serve.py``."""

import inspect
import json
import logging
import re
import shutil
import subprocess
import sys

import pytest
import torch
from moe_reference import random_layer, random_routing, slot_kernel
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_specexpert import features, metrics, report, vllm_hooks
from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.features import EngineFeature
from vllm_specexpert.features.lookahead import LookaheadFeature
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.stats import Series

NAMES = [f"model.layers.{i}.mlp.experts" for i in (1, 3)]


def scrape(directory) -> dict:
    registry = CollectorRegistry()
    registry.register(metrics.SnapshotCollector(str(directory)))
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def run_engine(directory, monkeypatch, **config) -> OffloadEngine:
    directory.mkdir(exist_ok=True)  # the frontend makes it; a write never does
    monkeypatch.setenv(metrics.DIRECTORY_ENV, str(directory))
    monkeypatch.setenv(metrics.MODEL_NAME_ENV, "tiny")
    engine = OffloadEngine(
        SpecExpertConfig.from_dict({"budget": 0.25, **config}), torch.device("cpu")
    )
    for index, name, seed in ((1, NAMES[0], 0), (3, NAMES[1], 1)):
        engine.add_layer(name, random_layer(seed=seed), top_k=4, index=index)
    engine.start()
    for step in range(3):
        for name in NAMES:
            x, w, ids = random_routing(4, 16, 4, seed=step)
            engine.run_call(LayerCall(name, slot_kernel, x, w, ids))
    engine.write_stats()
    return engine


def test_series_equal_the_engine_counters_per_layer_and_phase(tmp_path, monkeypatch):
    engine = run_engine(tmp_path, monkeypatch)
    stats = engine.stats()
    series = scrape(tmp_path)

    def labels(**extra):
        return tuple(sorted({"model_name": "tiny", "engine": "0", **extra}.items()))

    checked = 0
    for name, index in (("model.layers.1.mlp.experts", "1"), ("model.layers.3.mlp.experts", "3")):
        layer = stats["layers"][name]
        for phase in ("decode", "prefill"):
            for field, metric in (
                ("hits", "hits"),
                ("misses", "misses"),
                ("loads", "loads"),
                ("bytes_loaded", "bytes_loaded"),
                ("stall_s", "stall_seconds"),
            ):
                value = series[(f"specexpert_{metric}_total", labels(layer=index, phase=phase))]
                assert value == layer[phase][field]
                checked += value > 0
        assert series[("specexpert_slots", labels(layer=index))] == 4
        assert (
            series[("specexpert_resident_experts", labels(layer=index))]
            == stats["resident_per_layer"][name]
        )
    assert checked > 0  # some counters moved: the comparison could fail
    info = [k for k in series if k[0] == "specexpert_info"]
    assert [dict(k[1])["output"] for k in info] == ["exact"]
    engine.close()
    assert not list(tmp_path.glob("worker-*.json"))  # a closed engine leaves /metrics
    assert not [k for k in scrape(tmp_path) if k[0] == "specexpert_hits_total"]


def test_a_dead_workers_snapshot_is_not_served(tmp_path, monkeypatch):
    engine = run_engine(tmp_path, monkeypatch)
    snapshot = json.loads(next(tmp_path.glob("worker-*.json")).read_text())
    engine.close()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    (tmp_path / f"worker-{dead.stdout.strip()}.json").write_text(json.dumps(snapshot))
    assert not [k for k in scrape(tmp_path) if k[0].startswith("specexpert_")]


def test_several_api_servers_serve_the_series_on_their_metrics_route(tmp_path, monkeypatch):
    # With --api-server-count > 1, vLLM's /metrics route (the instrumentator's) builds a
    # registry around a MultiProcessCollector on every scrape: the hook adds ours to it.
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from prometheus_client import multiprocess
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router

    monkeypatch.setattr(multiprocess, "MultiProcessCollector", multiprocess.MultiProcessCollector)
    engine = run_engine(tmp_path / "snapshots", monkeypatch)
    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(multiproc))
    vllm_hooks.add_to_multiprocess_registries(metrics.environment_collector)
    # Idempotent: the collector joins once per registry.
    vllm_hooks.add_to_multiprocess_registries(metrics.environment_collector)
    app = FastAPI()
    attach_router(app)
    text = TestClient(app).get("/metrics").text
    hits = [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "specexpert_hits_total"
    ]
    assert len(hits) == 2 * len(NAMES)  # per layer and phase, once
    assert sum(s.value for s in hits) == sum(
        layer[phase]["hits"]
        for layer in engine.stats()["layers"].values()
        for phase in ("decode", "prefill")
    )
    engine.close()


def run_frontend(tmp_path, code: str = "") -> subprocess.CompletedProcess:
    """A process that prepares the frontend's snapshot directory under ``TMPDIR=tmp_path``
    (as the plugin does once an engine config passed its checks), then runs ``code``."""
    import os

    script = (
        "from vllm_specexpert import metrics; metrics.prepare_frontend('m'); "
        "import os; print(os.environ[metrics.DIRECTORY_ENV]); " + code
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop(metrics.DIRECTORY_ENV, None)
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )


def snapshot_directories(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(metrics.DIRECTORY_PREFIX))


def test_the_snapshot_directory_is_removed_when_the_frontend_exits(tmp_path):
    """Issue 22 (5): every server start used to leave a /tmp/specexpert-metrics-* behind."""
    done = run_frontend(tmp_path)
    assert done.returncode == 0, done.stderr
    made = done.stdout.strip().splitlines()[-1]
    assert made.startswith(str(tmp_path))  # it was made where we look
    assert snapshot_directories(tmp_path) == []
    failed = run_frontend(tmp_path, "raise SystemExit(2)")  # a start that failed after it
    assert failed.returncode == 2 and snapshot_directories(tmp_path) == []


# Slow: two killed frontends, 15 s; a frontend's own exit is
# test_the_snapshot_directory_is_removed_when_the_frontend_exits.
@pytest.mark.slow
def test_directories_of_killed_frontends_are_removed_by_the_next_one(tmp_path):
    import os

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    orphan = tmp_path / f"{metrics.DIRECTORY_PREFIX}{dead}-abc"
    live = tmp_path / f"{metrics.DIRECTORY_PREFIX}{os.getpid()}-abc"  # this process: alive
    for directory in (orphan, live):
        directory.mkdir()
        (directory / "worker-1.json").write_text("{}")
    # kill -9: the frontend's exit handler never runs; its start removed the orphan
    killed = run_frontend(tmp_path, "os.kill(os.getpid(), 9)")
    assert killed.returncode == -9
    left = snapshot_directories(tmp_path)
    assert orphan.name not in left and live.name in left and len(left) == 2
    assert run_frontend(tmp_path).returncode == 0
    assert snapshot_directories(tmp_path) == [live.name]


def logged_writing_and_closing(engine) -> list[str]:
    """What the stats writers log while ``engine`` writes its stats and closes."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("vllm_specexpert.stats_writers")
    logger.addHandler(handler)
    try:
        engine.write_stats()
        engine.close()
    finally:
        logger.removeHandler(handler)
    return [r.getMessage() for r in records]


def test_a_worker_that_outlives_its_frontend_writes_no_warning(tmp_path, monkeypatch):
    """Issue 46 (12): the process of ``LLM()`` removes the snapshot directory when it
    exits, and its worker runs a second or two longer: its next snapshot has nobody to
    read it. It was logged as ``cannot write metrics snapshot ... No such file``."""
    directory = tmp_path / "metrics"
    engine = run_engine(directory, monkeypatch)
    assert len(list(directory.glob("worker-*.json"))) == 1
    shutil.rmtree(directory)  # the frontend's exit
    assert logged_writing_and_closing(engine) == []
    assert not directory.exists()  # a write never makes it


def test_a_snapshot_directory_being_removed_during_a_write_logs_nothing(tmp_path, monkeypatch):
    """The frontend's removal at exit may be under way while a write runs: the directory
    is still there, the write's own file is gone. Seen at the end of a test run."""
    from vllm_specexpert import stats_writers

    directory = tmp_path / "metrics"
    engine = run_engine(directory, monkeypatch)

    def removed_meanwhile(path, payload):
        raise FileNotFoundError(2, "No such file or directory", f"{path}.tmp")

    monkeypatch.setattr(stats_writers, "write_json_atomic", removed_meanwhile)
    assert logged_writing_and_closing(engine) == []


def test_lookahead_series_equal_the_governors_counters(tmp_path, monkeypatch):
    tmp_path.mkdir(exist_ok=True)
    monkeypatch.setenv(metrics.DIRECTORY_ENV, str(tmp_path))
    monkeypatch.setenv(metrics.MODEL_NAME_ENV, "tiny")
    engine = OffloadEngine(
        SpecExpertConfig.from_dict({"budget": 0.25, "lookahead": {"explore_after_tokens": 0}}),
        torch.device("cpu"),
    )
    engine.add_layer(NAMES[0], random_layer(seed=0), top_k=4, index=1)
    engine.start()
    governor = engine.feature(LookaheadFeature).governor
    for _ in range(7):  # the warm-up's round robin: k = 4, 3, 2, 1, 0, 4, 3
        k = governor.choose(["a", "b"])
        governor.drafted(["a", "b"], k, 0.1)
        governor.verified({"a": (k, k // 2), "b": (k, k)} if k else {}, ["a", "b"], 0.9)
    engine.write_stats()
    stats = engine.stats()["lookahead"]
    series = scrape(tmp_path)
    base = {"model_name": "tiny", "engine": "0"}

    def value(name, **extra):
        return series[(name, tuple(sorted({**base, **extra}.items())))]

    assert stats["steps_by_k"] == {"0": 1, "1": 1, "2": 1, "3": 2, "4": 2}
    for k, count in stats["steps_by_k"].items():
        assert value("specexpert_lookahead_steps_total", k=k) == count
    assert value("specexpert_lookahead_draft_length") == 3 == stats["last_k"]
    assert value("specexpert_lookahead_drafted_tokens_total") == stats["drafted"] == 2 * 17
    assert value("specexpert_lookahead_accepted_tokens_total") == stats["accepted"] == 17 + 7
    engine.close()


class Probe(EngineFeature):
    """A feature the collector has never heard of: it supplies series of its own."""

    name = "probe"

    def series(self) -> list[Series]:
        widgets = Series("probe_widgets", "counter", "Widgets the probe counted.", ("colour",))
        return [widgets.add(3, "red").add(5, "blue"), Series("probe_idle", "gauge", "None yet.")]


def test_a_features_series_reach_metrics_without_the_collector_naming_it(tmp_path, monkeypatch):
    engine = run_engine(tmp_path, monkeypatch)
    assert not [k for k in scrape(tmp_path) if k[0].startswith("specexpert_probe")]
    engine.features.append(Probe())  # running, as the registry builds a feature
    engine.write_stats()
    registry = CollectorRegistry()
    registry.register(metrics.SnapshotCollector(str(tmp_path)))
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    widgets, idle = families["specexpert_probe_widgets"], families["specexpert_probe_idle"]
    assert (widgets.type, widgets.documentation) == ("counter", "Widgets the probe counted.")
    engine_labels = {"model_name": "tiny", "engine": "0"}
    assert [(s.name, s.labels, s.value) for s in widgets.samples] == [
        ("specexpert_probe_widgets_total", {**engine_labels, "colour": colour}, value)
        for colour, value in (("red", 3), ("blue", 5))
    ]
    assert (idle.type, idle.documentation, idle.samples) == ("gauge", "None yet.", [])
    assert "probe" not in engine.stats()  # no stats section: none given
    engine.close()


def test_metrics_and_report_name_no_feature():
    """Issue 47: each feature supplies its stats section and its /metrics series."""
    names = set(features.REGISTRY) | {cls.name for cls in features.feature_classes()}
    for module in (metrics, report):
        source = inspect.getsource(module)
        assert [n for n in sorted(names) if re.search(rf"\b{n}\b", source)] == []


def test_an_engine_that_does_not_report_writes_no_snapshot(tmp_path, monkeypatch):
    # The lookahead draft's engine shares its worker's pid with the target's: its own
    # snapshot would replace the target's on /metrics.
    monkeypatch.setenv(metrics.DIRECTORY_ENV, str(tmp_path))
    engine = OffloadEngine(
        SpecExpertConfig.from_dict({"budget": 0.25}), torch.device("cpu"), reports=False
    )
    engine.add_layer(NAMES[0], random_layer(seed=0), top_k=4, index=1)
    engine.start()
    engine.write_stats()
    assert not list(tmp_path.iterdir())
    engine.close()


def test_mesh_peer_series_equal_the_peers_counters(tmp_path, monkeypatch):
    from vllm_specexpert.peers.tier import PeerState

    monkeypatch.setenv(metrics.DIRECTORY_ENV, str(tmp_path))
    monkeypatch.setenv(metrics.MODEL_NAME_ENV, "tiny")
    states = [
        PeerState(rank=0, actor=None, node="n0", calls=5, pairs=17, failures=1, compute_s=0.25),
        PeerState(rank=1, actor=None, node="n1", calls=3, timeouts=2),
    ]
    states[1].leave("hung")
    states[0].rtts.extend([0.010, 0.030, 0.020])

    class Peers:  # what the engine reads of a peer tier
        peers = states

        def hosted(self, layer):
            return torch.zeros(16, dtype=torch.bool).numpy()

        def stats(self):
            return {"peers": [p.stats() for p in states]}

    engine = OffloadEngine(
        SpecExpertConfig.from_dict({"budget": 0.25, "mesh": {}}), torch.device("cpu")
    )
    engine.add_layer(NAMES[0], random_layer(seed=0), top_k=4, index=1)
    engine.provide(peer_tier=Peers())
    engine.start()
    engine.write_stats()
    series = scrape(tmp_path)

    def value(name, peer):
        labels = {"model_name": "tiny", "engine": "0", "peer": str(peer)}
        return series[(name, tuple(sorted(labels.items())))]

    assert value("specexpert_peer_calls_total", 0) == 5
    assert value("specexpert_peer_pairs_total", 0) == 17
    assert value("specexpert_peer_failures_total", 0) == 1
    assert value("specexpert_peer_compute_seconds_total", 0) == 0.25
    assert value("specexpert_peer_timeouts_total", 1) == 2
    assert value("specexpert_peer_left_total", 1) == 1
    assert value("specexpert_peer_up", 0) == 1 and value("specexpert_peer_up", 1) == 0
    assert value("specexpert_peer_rtt_seconds", 0) == 0.020  # the median
    assert (
        "specexpert_peer_rtt_seconds",
        tuple(sorted({"model_name": "tiny", "engine": "0", "peer": "1"}.items())),
    ) not in series
    engine_labels = tuple(sorted({"model_name": "tiny", "engine": "0"}.items()))
    assert series[("specexpert_mesh_peers_in_rotation", engine_labels)] == 1
    assert series[("specexpert_mesh_peers", engine_labels)] == 2
    engine.reporter.close()


def test_scheduler_series_equal_the_schedulers_counters(tmp_path, monkeypatch):
    # The scheduler (engine-core process) attaches its counters to each step's
    # SchedulerOutput; the worker keeps the latest, and its stats and snapshot carry them.
    import dataclasses
    from types import SimpleNamespace

    from vllm_specexpert import handoff

    monkeypatch.setattr(handoff, "_scheduler_stats", None)
    counted = handoff.SchedulerStats(
        steps=40,
        grouped_steps=9,
        ungrouped_steps=5,
        held=27,
        max_waited=2,
        pairs_run=700,
        pairs_all=1100,
        pairs_in_order=780,
        cpu_s=0.375,
        max_step_cpu_s=0.0625,
    )
    step = SimpleNamespace()  # what the worker receives: the pickled SchedulerOutput
    handoff.attach_scheduler_stats(step, dataclasses.asdict(counted))
    handoff.receive(step)
    # The scheduler's counters are reported where it runs: with a path predictor (the
    # worker never opens its directory: the scheduler process does).
    plain = run_engine(tmp_path / "plain", monkeypatch)
    assert "scheduler" not in plain.stats()
    assert not [k for k in scrape(tmp_path / "plain") if k[0].startswith("specexpert_scheduler_")]
    plain.close()
    engine = run_engine(tmp_path, monkeypatch, path_predictor=str(tmp_path / "path"))
    assert engine.stats()["scheduler"] == dataclasses.asdict(counted)
    series = scrape(tmp_path)
    labels = tuple(sorted({"model_name": "tiny", "engine": "0"}.items()))
    expected = {
        "specexpert_scheduler_steps_total": 40,
        "specexpert_scheduler_grouped_steps_total": 9,
        "specexpert_scheduler_ungrouped_steps_total": 5,
        "specexpert_scheduler_held_total": 27,
        "specexpert_scheduler_max_waited": 2,
        "specexpert_scheduler_pairs_run_total": 700,
        "specexpert_scheduler_pairs_all_total": 1100,
        "specexpert_scheduler_pairs_in_order_total": 780,
        "specexpert_scheduler_cpu_seconds_total": 0.375,
        "specexpert_scheduler_max_step_cpu_seconds": 0.0625,
    }
    assert len(expected) == len(dataclasses.fields(handoff.SchedulerStats))  # all of them
    assert {name: series.get((name, labels)) for name in expected} == expected
    # A step of a scheduler without counters (vLLM's own) leaves none to report.
    handoff.receive(SimpleNamespace())
    engine.write_stats()
    assert "scheduler" not in engine.stats()
    assert not [k for k in scrape(tmp_path) if k[0].startswith("specexpert_scheduler_")]
    engine.close()


def test_a_containers_memory_limit_is_a_budget_part(tmp_path, monkeypatch):
    import dataclasses

    from vllm_specexpert import budget_plan
    from vllm_specexpert.tiers import memory

    limit = 6 << 30

    def in_a_container(device, settings, freed_bytes=0):
        report = memory.memory_report(device, settings, freed_bytes)
        return dataclasses.replace(report, cgroup_limit_bytes=limit)

    monkeypatch.setattr(budget_plan, "memory_report", in_a_container)
    monkeypatch.setenv(metrics.DIRECTORY_ENV, str(tmp_path))
    monkeypatch.setenv(metrics.MODEL_NAME_ENV, "tiny")
    engine = OffloadEngine(SpecExpertConfig.from_dict({"budget": 0.25}), torch.device("cpu"))
    engine.budget.sizing.moe_layers = 1
    engine.add_layer(NAMES[0], random_layer(seed=0), top_k=4, index=1)
    engine.start()
    engine.write_stats()
    labels = {"model_name": "tiny", "engine": "0", "part": "cgroup_limit"}
    assert scrape(tmp_path)[("specexpert_budget_bytes", tuple(sorted(labels.items())))] == limit
    engine.close()


def test_only_an_engine_a_server_serves_gets_a_snapshot_directory(monkeypatch):
    # LLM() builds its engine from EngineArgs: no /metrics reads its snapshots, so no
    # directory and no collector; vLLM's API server builds from AsyncEngineArgs.
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    from vllm_specexpert import validate

    made: list[str] = []
    monkeypatch.setattr(validate, "validate_engine_config", lambda *args: None)
    monkeypatch.setattr("vllm_specexpert.layers.sizing.size_cpu_kv_cache", lambda c, **chosen: None)
    monkeypatch.setattr(validate.metrics, "prepare_frontend", made.append)
    config = SpecExpertConfig()
    validate.after_engine_config(EngineArgs(model="m"), None, config)
    assert made == []
    served = AsyncEngineArgs(model="m", served_model_name=["served"])
    validate.after_engine_config(served, None, config)
    assert made == ["served"]
