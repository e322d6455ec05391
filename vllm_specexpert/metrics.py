"""Prometheus metrics: the engine's counters on the server's ``/metrics``.

The counters live in the worker processes and ``/metrics`` is served by the API server
process, so they cross processes as ``stats_path`` does: each worker writes a snapshot
of its stats every :data:`SNAPSHOT_INTERVAL_S` (a stats thread, never the forward pass)
into a directory the frontend made (:data:`DIRECTORY_ENV`), and a collector in the
frontend's prometheus registry reads the live workers' snapshots at each scrape. The
engine's own series (per layer and phase, residency, budget, disk) are built
here from the stats; each feature supplies its series as data in the worker
(:class:`~vllm_specexpert.stats.Series`, under :data:`SERIES`), served as given: this
module names no feature. The list of series: ``docs/metrics.md``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_specexpert.stats import PhaseStats, metric_name

DIRECTORY_ENV = "SPECEXPERT_METRICS_DIR"
"""Directory of the workers' snapshots (set by the frontend before engines start)."""
MODEL_NAME_ENV = "SPECEXPERT_MODEL_NAME"
"""Served model name, the ``model_name`` label."""
SNAPSHOT_INTERVAL_S = 1.0
SERIES = "series"
"""The snapshot's key of the features' series (:func:`vllm_specexpert.report.feature_series`)."""
PREFIX = "specexpert_"
BUDGET_PARTS = ("room", "kv", "workspace", "reserve", "space", "cgroup_limit")
"""The parts of ``specexpert_budget_bytes`` beside ``slots`` (:mod:`.config.sizing`)."""

_lock = threading.Lock()
_collector: SnapshotCollector | None = None


def snapshot_path(directory: str) -> str:
    """Where this worker process writes its snapshot."""
    return os.path.join(directory, f"worker-{os.getpid()}.json")


DIRECTORY_PREFIX = "specexpert-metrics-"
"""Snapshot directories are ``<tmp>/specexpert-metrics-<pid of the frontend>-<random>``."""


def prepare_frontend(model_name: str) -> None:
    """In the process that builds engine configs, once its config passed every check:
    make the snapshot directory (once per process; removed when the process exits),
    name the model for the engine processes about to start, and register the collector
    in prometheus_client's default registry (what vLLM's ``/metrics`` serves with one
    API server)."""
    global _collector
    with _lock:
        if DIRECTORY_ENV not in os.environ:
            remove_orphaned_directories()
            directory = tempfile.mkdtemp(prefix=f"{DIRECTORY_PREFIX}{os.getpid()}-")
            atexit.register(_remove_directory, directory, os.getpid())
            os.environ[DIRECTORY_ENV] = directory
        os.environ[MODEL_NAME_ENV] = model_name
        if _collector is None:
            from prometheus_client import REGISTRY

            _collector = SnapshotCollector(os.environ[DIRECTORY_ENV])
            REGISTRY.register(_collector)


def _remove_directory(directory: str, owner_pid: int) -> None:
    """At exit of the process that made ``directory`` (not of a child that inherited
    the registration through fork)."""
    if os.getpid() == owner_pid:
        shutil.rmtree(directory, ignore_errors=True)


def remove_orphaned_directories(root: str | None = None) -> list[str]:
    """Remove the snapshot directories whose frontend process is gone (killed before
    it could remove its own). Returns what was removed."""
    removed = []
    root = root or tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            if not (entry.name.startswith(DIRECTORY_PREFIX) and entry.is_dir()):
                continue
            pid = entry.name[len(DIRECTORY_PREFIX) :].split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    return removed


def environment_collector() -> SnapshotCollector | None:
    """A collector over the snapshot directory this process inherited (``None``
    without one): what every registry ``/metrics`` builds gets, with several API
    servers (see :func:`vllm_specexpert.vllm_hooks.add_to_multiprocess_registries`;
    every API server then reports all workers' series, and a scrape reaches one API
    server, so nothing is counted twice)."""
    directory = os.environ.get(DIRECTORY_ENV)
    return SnapshotCollector(directory) if directory else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def counter_name(field: str) -> str:
    """``specexpert_<field>_total``; seconds (``*_s``) as ``*_seconds_total``."""
    return f"{PREFIX}{metric_name(field)}"


class SnapshotCollector:
    """A prometheus_client collector over the workers' snapshot files."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self.docs = PhaseStats.docs()
        self.fields = list(self.docs)

    def snapshots(self) -> list[dict[str, Any]]:
        """The live workers' latest snapshots, one per engine rank (the newest)."""
        by_rank: dict[Any, tuple[float, dict]] = {}
        for path in self.directory.glob("worker-*.json"):
            try:
                pid = int(path.stem.split("-", 1)[1])
                if not _alive(pid):
                    continue
                mtime = path.stat().st_mtime
                snapshot = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # being replaced, or gone
            rank = snapshot.get("rank")
            if rank not in by_rank or mtime > by_rank[rank][0]:
                by_rank[rank] = (mtime, snapshot)
        ordered = sorted(by_rank.values(), key=lambda item: str(item[1].get("rank")))
        return [snapshot for _, snapshot in ordered]

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        base = ["model_name", "engine"]
        counters = {
            f: CounterMetricFamily(
                counter_name(f), self.docs.get(f, f), labels=[*base, "layer", "phase"]
            )
            for f in self.fields
        }
        resident = GaugeMetricFamily(
            f"{PREFIX}resident_experts",
            "Experts resident on the device now, per MoE layer.",
            labels=[*base, "layer"],
        )
        slots = GaugeMetricFamily(
            f"{PREFIX}slots",
            "Device cache slots of the MoE layer (its share of the pool under cache: plec).",
            labels=[*base, "layer"],
        )
        budget = GaugeMetricFamily(
            f"{PREFIX}budget_bytes",
            "What the budget was sized from, in bytes (part: slots, the device tier's "
            "slots over all MoE layers; room, kv, workspace, reserve, space: the memory "
            "sizing found and what it left out).",
            labels=[*base, "part"],
        )
        info = GaugeMetricFamily(
            f"{PREFIX}info",
            "The running configuration (value 1).",
            labels=[*base, "miss_policy", "cache", "predictor", "output"],
        )
        disk = {
            key: CounterMetricFamily(counter_name(f"disk_{key}"), doc, labels=base)
            for key, doc in DISK_COUNTERS.items()
        }
        snapshots = self.snapshots()
        for snapshot in snapshots:
            labels = engine_labels(snapshot)
            if snapshot.get("disk"):
                for key, family in disk.items():
                    if key in snapshot["disk"]:  # (the mapped residency has no reads of its own)
                        family.add_metric(labels, snapshot["disk"][key])
            layer_index = snapshot.get("layer_index", {})
            for name, layer in snapshot["layers"].items():
                layer_label = str(layer_index.get(name, name))
                for phase in ("decode", "prefill"):
                    for f in self.fields:
                        counters[f].add_metric([*labels, layer_label, phase], layer[phase][f])
                resident.add_metric([*labels, layer_label], snapshot["resident_per_layer"][name])
                slots.add_metric([*labels, layer_label], snapshot["slots_per_layer"][name])
            fit = snapshot.get("budget")
            if fit:
                budget.add_metric([*labels, "slots"], fit["slot_bytes"])
                for part in BUDGET_PARTS:
                    if f"{part}_bytes" in fit:
                        budget.add_metric([*labels, part], fit[f"{part}_bytes"])
            config = snapshot["config"]
            info.add_metric(
                [
                    *labels,
                    snapshot["miss_policy"],
                    config["cache"],
                    snapshot["predictor"],
                    snapshot["output"],
                ],
                1,
            )
        yield from counters.values()
        yield from (resident, slots, budget, info)
        yield from disk.values()
        yield from supplied_families(base, snapshots)


DISK_COUNTERS = {
    "reads": "Experts read from the disk tier's pack.",
    "bytes": "Bytes read from the disk tier's pack.",
    "wait_s": "Seconds expert copies waited for disk reads.",
    "busy_s": "Seconds at least one disk read was in flight.",
    "checked": (
        "Experts checked against their checksums (slots: at every read; mapped: at first use, "
        "when their pages were read in, and after the pack was written to)."
    ),
    "failed": "Expert reads that failed (I/O error or checksum); their requests failed.",
}
"""The disk tier's counters on ``/metrics`` (``specexpert_disk_<key>_total``)."""


def engine_labels(snapshot: dict[str, Any]) -> list[str]:
    """The values of the labels every series starts with (``model_name``, ``engine``)."""
    return [snapshot.get("model_name", ""), str(snapshot.get("rank", 0))]


def supplied_families(base: list[str], snapshots: list[dict[str, Any]]) -> Iterator:
    """The series the features supplied (:class:`~vllm_specexpert.stats.Series` as JSON),
    one family per name over every snapshot, the engine's labels (``base``) first."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
    for snapshot in snapshots:
        labels = engine_labels(snapshot)
        for series in snapshot.get(SERIES, []):
            family = families.get(series["name"])
            if family is None:
                kind = CounterMetricFamily if series["kind"] == "counter" else GaugeMetricFamily
                family = families[series["name"]] = kind(
                    f"{PREFIX}{series['name']}", series["help"], labels=[*base, *series["labels"]]
                )
            for values, value in series["samples"]:
                family.add_metric([*labels, *values], value)
    yield from families.values()
