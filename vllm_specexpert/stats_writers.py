"""The threads that write an engine's statistics to files, off the forward pass: the
``stats_path`` file and, in a server, the snapshot the frontend serves on ``/metrics``."""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

from vllm_specexpert import metrics
from vllm_specexpert.log import init_logger
from vllm_specexpert.stats import check_stats_path, write_json_atomic

logger = init_logger(__name__)


class StatsWriter:
    """Writes ``snapshot()`` to ``path`` every ``interval_s`` seconds from a daemon
    thread (never from the forward pass), and once more at :meth:`close`. A failed write
    is logged once and retried at the next interval: it never stops the engine. With
    ``reader_owns_directory`` (the ``/metrics`` snapshot), a directory that is gone means
    its reader is: the process that made it removes it at exit, which an ``LLM()``'s
    workers outlive by a second or two. The writer then stops without a word."""

    MIN_INTERVAL_S = 0.1
    """Shortest period between writes (``stats_interval_s: 0`` writes at this rate)."""

    def __init__(
        self,
        path: str,
        interval_s: float,
        snapshot: Callable[[], dict],
        what: str = "stats_path",
        write_last: bool = True,
        reader_owns_directory: bool = False,
    ):
        self.path = path
        self.what = what
        """What the file is, for the log line of a failed write."""
        self.write_last = write_last
        """Whether :meth:`close` (also at exit) writes a last time."""
        self.reader_owns_directory = reader_owns_directory
        """Whether the directory's removal means nobody reads the file any more."""
        self.interval_s = max(interval_s, self.MIN_INTERVAL_S)
        self.snapshot = snapshot
        self._stop = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._loop, name="specexpert-stats", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def write(self) -> None:
        try:
            write_json_atomic(self.path, self.snapshot())
        except OSError as error:
            gone = isinstance(error, FileNotFoundError)  # (its removal may be under way)
            if self.reader_owns_directory and (
                gone or not os.path.isdir(os.path.dirname(self.path))
            ):
                self._stop.set()  # no more periodic writes
                return
            if not self._warned:
                logger.warning("specexpert: cannot write %s %s: %s", self.what, self.path, error)
                self._warned = True

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write()

    def close(self) -> None:
        """Stop the thread (and write once more if ``write_last``)."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(timeout=5)
            if self.write_last:
                self.write()


class Reporter:
    """The file writers of one engine: ``stats_path`` (every ``stats_interval_s``) and,
    in a server, the snapshot the frontend serves on ``/metrics`` (every
    :data:`~vllm_specexpert.metrics.SNAPSHOT_INTERVAL_S`). ``snapshot`` is the engine's
    :func:`engine_stats`; ``None``: nothing is written (the lookahead draft's engine,
    whose stats are part of its target's). ``series``: the features' ``/metrics`` series
    (:func:`~vllm_specexpert.report.feature_series`), in the metrics snapshot only."""

    def __init__(
        self,
        snapshot: Callable[[], dict[str, Any]] | None,
        series: Callable[[], list[dict[str, Any]]] = list,
    ):
        self.snapshot = snapshot
        self.series = series
        self._stats_writer: StatsWriter | None = None
        self._metrics_writer: StatsWriter | None = None

    def start(self, stats_file: str | None, interval_s: float) -> None:
        """(Re)start the writers for the engine's current config."""
        if self.snapshot is None:
            return
        if self._stats_writer is not None:
            self._stats_writer.close()
            self._stats_writer = None
        directory = os.environ.get(metrics.DIRECTORY_ENV)
        snapshot, series = self.snapshot, self.series
        if directory and self._metrics_writer is None and snapshot is not None:
            model_name = os.environ.get(metrics.MODEL_NAME_ENV, "")
            self._metrics_writer = StatsWriter(
                metrics.snapshot_path(directory),
                metrics.SNAPSHOT_INTERVAL_S,
                lambda: {**snapshot(), metrics.SERIES: series(), "model_name": model_name},
                what="metrics snapshot",
                write_last=False,
                reader_owns_directory=True,
            )
        if stats_file:
            check_stats_path(stats_file)
            self._stats_writer = StatsWriter(stats_file, interval_s, self.snapshot)

    def write_now(self) -> None:
        """Write the stats file now (``stats_path``; no-op without one) and the metrics
        snapshot (no-op outside a server)."""
        for writer in (self._stats_writer, self._metrics_writer):
            if writer is not None:
                writer.write()

    def close(self) -> None:
        if self._stats_writer is not None:
            self._stats_writer.close()
        if self._metrics_writer is not None:
            self._metrics_writer.close()
            with contextlib.suppress(OSError):  # a closed engine leaves /metrics
                os.remove(self._metrics_writer.path)
            self._metrics_writer = None
