"""Prometheus metrics: the engine's counters on the server's ``/metrics``.

The counters live in the worker processes (one :class:`~vllm_specexpert.engine.OffloadEngine`
each) and ``/metrics`` is served by the API server process, so they cross processes the
way ``stats_path`` does: each worker writes a snapshot of its :meth:`OffloadEngine.stats`
every :data:`SNAPSHOT_INTERVAL_S` (from its stats thread, never from the forward pass) into
a directory the frontend creates (:data:`DIRECTORY_ENV`, inherited by the engine
processes), and a collector registered in the frontend's default prometheus registry reads
the snapshots at each scrape. Files of processes that died are skipped.

Series (vLLM's label convention: ``model_name``, ``engine`` = worker rank):

- ``specexpert_<counter>_total{layer, phase}``: every counter of
  :class:`~vllm_specexpert.stats.PhaseStats` per MoE layer (decoder-layer index) and
  phase (``decode`` / ``prefill``): hits, misses, loads, evictions, bytes loaded,
  prefetches (used, unused, cancelled, skipped), host and substituted entries, ...;
  seconds as ``specexpert_<name>_seconds_total``. They restart at zero after
  ``reconfigure`` or ``reset_stats`` (Prometheus reads that as a counter reset).
- ``specexpert_resident_experts{layer}``, ``specexpert_slots{layer}``: gauges.
- ``specexpert_budget_bytes{part}``: the slots' bytes over all MoE layers (``slots``)
  and what sizing found free and left out (``room``, ``kv``, ``workspace``, ``reserve``,
  ``space``).
- ``specexpert_info{miss_policy, cache, predictor, output}``: 1.
- ``mesh``: ``specexpert_mesh_peers_in_rotation`` (and ``specexpert_mesh_peers``, all
  of them), ``specexpert_peer_up{peer}`` (1: in rotation), ``specexpert_peer_rtt_seconds
  {peer}`` (median probe round trip) and per peer the counters of
  :data:`PEER_COUNTERS` (``specexpert_peer_calls_total{peer}``, ...).
- ``quality``: per decode batch class ``specexpert_quality_exact{batch}`` (1: its
  passes run exactly, over budget), ``specexpert_quality_window_accuracy_loss{batch}``
  and ``..._window_flip_rate{batch}`` (the last window's), the counters of
  :data:`QUALITY_COUNTERS` (``specexpert_quality_sampled_tokens_total``, ...),
  ``specexpert_quality_switches_total{to}`` and per MoE layer
  ``specexpert_quality_layer_top1_flips_total{layer}`` and ``..._layer_tokens_total``.
- ``disk``: the counters of :data:`DISK_COUNTERS` (``specexpert_disk_reads_total``,
  ``..._bytes_total``, ``..._wait_seconds_total``, ``..._busy_seconds_total``,
  ``..._checked_total``).
- ``path_predictor``: the scheduler's counters (:class:`~vllm_specexpert.handoff.
  SchedulerStats`), counted in the engine-core process and carried to the worker with
  every step (:mod:`vllm_specexpert.handoff`), so its snapshot has them (the plugin runs
  one worker per engine: they appear once):
  ``specexpert_scheduler_steps_total``, ``..._grouped_steps_total``, ``..._held_total``
  (sequence-steps held back), ``..._pairs_run_total``, ``..._pairs_all_total``,
  ``..._pairs_in_order_total`` (predicted (layer, expert) pairs), ``..._cpu_seconds_total``
  and gauges ``specexpert_scheduler_max_waited`` (steps) and
  ``specexpert_scheduler_max_step_cpu_seconds``. They count from the engine's start:
  ``reset_stats`` and ``reconfigure`` reach the workers, not the scheduler.

Snapshots are at most :data:`SNAPSHOT_INTERVAL_S` old; ``get_stats`` and ``stats_path``
remain the exact, per-call view.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_specexpert.handoff import SchedulerStats
from vllm_specexpert.stats import PhaseStats

DIRECTORY_ENV = "SPECEXPERT_METRICS_DIR"
"""Directory of the workers' snapshots (set by the frontend before engines start)."""
MODEL_NAME_ENV = "SPECEXPERT_MODEL_NAME"
"""Served model name, the ``model_name`` label."""
SNAPSHOT_INTERVAL_S = 1.0
PEER_COUNTERS = {
    "calls": "Calls answered by the peer.",
    "pairs": "(token, expert) pairs it computed.",
    "bytes_sent": "Bytes of rows sent to it.",
    "bytes_received": "Bytes of outputs it sent.",
    "compute_s": "Seconds it spent computing.",
    "failures": "Calls that failed (it died).",
    "timeouts": "Calls not answered within mesh.timeout_ms.",
    "left": "Times it left the rotation.",
    "rejoined": "Times it rejoined the rotation.",
}
"""Per-peer counters of a mesh peer's stats (``PeerTier.stats``), by stats key."""
QUALITY_COUNTERS = {
    "sampled_tokens": "Decode tokens recomputed exactly beside the served result.",
    "top1_flips": "Sampled tokens whose exact and approximate top-1 token differ.",
    "kl_sum": "Sum over sampled tokens of KL(exact || approximate) of the final logits, nats.",
    "accuracy_loss_sum": "Sum over sampled tokens of p[exact top-1] - p[approximate "
    "top-1], p the exact next-token probabilities.",
    "exact_confidence_sum": "Sum over sampled tokens of p[exact top-1] (the accuracy "
    "loss's denominator).",
    "exact_passes": "Decode passes run exactly because of the budget.",
    "shadow_s": "Seconds spent on the shadow computations.",
    "shadow_bytes": "Bytes the shadow computations loaded.",
}
"""Counters of the quality monitor (``QualityMonitor.stats``), by stats key."""
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
    base = f"{field[:-2]}_seconds" if field.endswith("_s") else field
    return f"{PREFIX}{base}"


class SnapshotCollector:
    """A prometheus_client collector over the workers' snapshot files."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self.fields = [f.name for f in dataclasses.fields(PhaseStats)]
        self.docs = {f.name: f.metadata["help"] for f in dataclasses.fields(PhaseStats)}

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
        steps = CounterMetricFamily(
            f"{PREFIX}lookahead_steps",
            "Steps per draft length the lookahead governor chose.",
            labels=[*base, "k"],
        )
        draft_length = GaugeMetricFamily(
            f"{PREFIX}lookahead_draft_length", "The draft length chosen last.", labels=base
        )
        drafted = CounterMetricFamily(
            f"{PREFIX}lookahead_drafted_tokens",
            "Drafted tokens verified by the target.",
            labels=base,
        )
        accepted = CounterMetricFamily(
            f"{PREFIX}lookahead_accepted_tokens", "Drafted tokens the target accepted.", labels=base
        )
        peer = [*base, "peer"]
        peer_counters = {
            key: CounterMetricFamily(counter_name(f"peer_{key}"), doc, labels=peer)
            for key, doc in PEER_COUNTERS.items()
        }
        peer_up = GaugeMetricFamily(
            f"{PREFIX}peer_up", "1 while the mesh peer is in rotation.", labels=peer
        )
        peer_rtt = GaugeMetricFamily(
            f"{PREFIX}peer_rtt_seconds", "The mesh peer's median probe round trip.", labels=peer
        )
        in_rotation = GaugeMetricFamily(
            f"{PREFIX}mesh_peers_in_rotation",
            "Mesh peers in rotation (the others' experts are computed here).",
            labels=base,
        )
        peers_started = GaugeMetricFamily(f"{PREFIX}mesh_peers", "Mesh peers started.", labels=base)
        disk = {
            key: CounterMetricFamily(counter_name(f"disk_{key}"), doc, labels=base)
            for key, doc in DISK_COUNTERS.items()
        }
        quality = _QualityFamilies(base)
        scheduler = {
            f.name: (GaugeMetricFamily if f.metadata.get("gauge") else CounterMetricFamily)(
                counter_name(f"scheduler_{f.name}"), f.metadata["help"], labels=base
            )
            for f in dataclasses.fields(SchedulerStats)
        }
        for snapshot in self.snapshots():
            labels = [snapshot.get("model_name", ""), str(snapshot.get("rank", 0))]
            quality.add(labels, snapshot.get("quality"))
            if snapshot.get("scheduler"):
                for key, family in scheduler.items():
                    family.add_metric(labels, snapshot["scheduler"][key])
            if snapshot.get("disk"):
                for key, family in disk.items():
                    family.add_metric(labels, snapshot["disk"][key])
            mesh = snapshot.get("mesh")
            if mesh:
                in_rotation.add_metric(labels, sum(p["up"] for p in mesh["peers"]))
                peers_started.add_metric(labels, len(mesh["peers"]))
            for state in (mesh or {}).get("peers", []):
                rank = [*labels, str(state["rank"])]
                for key, family in peer_counters.items():
                    family.add_metric(rank, state[key])
                peer_up.add_metric(rank, float(state["up"]))
                if state["rtt_ms"] is not None:
                    peer_rtt.add_metric(rank, state["rtt_ms"] / 1e3)
            lookahead = snapshot.get("lookahead")
            if lookahead:
                for k, count in lookahead["steps_by_k"].items():
                    steps.add_metric([*labels, str(k)], count)
                if lookahead["last_k"] is not None:
                    draft_length.add_metric(labels, lookahead["last_k"])
                drafted.add_metric(labels, lookahead["drafted"])
                accepted.add_metric(labels, lookahead["accepted"])
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
        yield from (resident, slots, budget, info, steps, draft_length, drafted, accepted)
        yield from (*peer_counters.values(), peer_up, peer_rtt, in_rotation, peers_started)
        yield from quality.families()
        yield from scheduler.values()
        yield from disk.values()


DISK_COUNTERS = {
    "reads": "Experts read from the disk tier's pack.",
    "bytes": "Bytes read from the disk tier's pack.",
    "wait_s": "Seconds expert copies waited for disk reads.",
    "busy_s": "Seconds at least one disk read was in flight.",
    "checked": "Records checked against their checksum (each once, at its first read).",
    "failed": "Expert reads that failed (I/O error or checksum); their requests failed.",
}
"""The disk tier's counters on ``/metrics`` (``specexpert_disk_<key>_total``)."""


class _QualityFamilies:
    """The ``specexpert_quality_*`` series (module doc)."""

    def __init__(self, base: list[str]) -> None:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        batch = [*base, "batch"]
        self.exact = GaugeMetricFamily(
            f"{PREFIX}quality_exact",
            "1 while the decode "
            "passes of this batch class run exactly because "
            "the quality budget was exceeded.",
            labels=batch,
        )
        self.loss = GaugeMetricFamily(
            f"{PREFIX}quality_window_accuracy_loss",
            "Estimated accuracy loss of the batch class's last completed window.",
            labels=batch,
        )
        self.rate = GaugeMetricFamily(
            f"{PREFIX}quality_window_flip_rate",
            "Top-1 flip rate of the batch class's last completed window.",
            labels=batch,
        )
        self.counters = {
            key: CounterMetricFamily(counter_name(f"quality_{key}"), doc, labels=base)
            for key, doc in QUALITY_COUNTERS.items()
        }
        self.switches = CounterMetricFamily(
            f"{PREFIX}quality_switches",
            "Switches to the exact policy and back.",
            labels=[*base, "to"],
        )
        self.layer_flips = CounterMetricFamily(
            f"{PREFIX}quality_layer_top1_flips",
            "Sampled tokens whose top-1 token that layer's difference alone flips.",
            labels=[*base, "layer"],
        )
        self.layer_tokens = CounterMetricFamily(
            f"{PREFIX}quality_layer_tokens",
            "Sampled tokens whose result that layer changed.",
            labels=[*base, "layer"],
        )

    def add(self, labels: list[str], quality: dict | None) -> None:
        if not quality:
            return
        for label, batch in quality["batches"].items():
            self.exact.add_metric([*labels, label], float(batch["exact"]))
            for family, key in (
                (self.loss, "last_window_accuracy_loss"),
                (self.rate, "last_window_flip_rate"),
            ):
                if batch[key] is not None:
                    family.add_metric([*labels, label], batch[key])
        for key, counter in self.counters.items():
            counter.add_metric(labels, quality[key])
        self.switches.add_metric([*labels, "exact"], quality["switches_to_exact"])
        self.switches.add_metric([*labels, "approximate"], quality["switches_to_approximate"])
        for index, layer in quality["layers"].items():
            self.layer_flips.add_metric([*labels, str(index)], layer["top1_flips"])
            self.layer_tokens.add_metric([*labels, str(index)], layer["tokens"])

    def families(self) -> Iterator:
        yield from (
            self.exact,
            self.loss,
            self.rate,
            *self.counters.values(),
            self.switches,
            self.layer_flips,
            self.layer_tokens,
        )
