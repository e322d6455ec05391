"""The Grafana dashboard against a real Prometheus (Debian's ``prometheus``, installed by
``make setup``; ``tests/test_serve.py`` runs it): Prometheus scrapes a running
``specexpert serve`` with traffic while it scrapes, and every query of
``docs/grafana/specexpert.json`` is evaluated by Prometheus against what it scraped:
each returns a series, with the labels its panel's legend names
(:func:`check_dashboard`).

The series of the mesh, the quality budget, prediction and the places (host,
substitutes, INT4 copies) appear only while their feature runs, and none runs beside
such a server (the mesh needs Ray peers; the others are other modes): for their panels
Prometheus also scrapes an exporter per feature in the test process, each serving the
exposition of a toy engine with that feature (as ``tests/test_dashboard.py`` makes
them) under the served model's name, as scraped once.
"""

import json
import re
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
import torch
from test_dashboard import ENGINES, dashboard, panels, scraped

from vllm_specexpert.tools.server import free_port

LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
RATE_INTERVAL = "30s"
"""``$__rate_interval``: Grafana's is at least four scrape intervals (here 1 s)."""
INFO_LABELS = {"miss_policy", "cache", "predictor", "output"}
"""What the "Running configuration" table shows of ``specexpert_info``."""


def exporter(text: str) -> tuple[int, ThreadingHTTPServer]:
    """An HTTP server on 127.0.0.1 that answers every GET with ``text`` (an exposition
    the plugin's collector rendered): ``(port, server)``."""

    class Exposition(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Exposition)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.server_address[1], server


def judged_window(engine) -> None:
    """The quality budget's final-norm comparison of the call's sampled rows (what the
    final tap does at the end of a pass), which completes a window."""
    from vllm_specexpert.features.quality import QualityFeature

    feature = engine.feature(QualityFeature)
    assert feature is not None and feature.monitor.pending
    rows = feature.monitor.rows
    feature.monitor.finish_pass(
        torch.randn(len(rows), 32, generator=torch.Generator().manual_seed(0))
    )


def start_prometheus(binary: str, work: Path, targets: list[int]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    config = work / "prometheus.yml"
    config.write_text(
        json.dumps(  # (YAML takes JSON)
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "specexpert",
                        "static_configs": [{"targets": [f"127.0.0.1:{t}" for t in targets]}],
                    }
                ],
            }
        )
    )
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(work / "prometheus.log", "w"),  # noqa: SIM115 - the child keeps it
    )
    for _ in range(600):
        try:
            if requests.get(f"http://127.0.0.1:{port}/-/ready", timeout=1).status_code == 200:
                return process, port
        except requests.ConnectionError:
            pass
        if process.poll() is not None:
            break
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"prometheus did not start: {(work / 'prometheus.log').read_text()[-500:]}")


def query(port: int, expr: str) -> list[dict]:
    response = requests.get(
        f"http://127.0.0.1:{port}/api/v1/query", params={"query": expr}, timeout=30
    )
    body = response.json()
    assert body.get("status") == "success", (expr, body)
    return body["data"]["result"]


def scraped_enough(port: int, targets: int) -> bool:
    """Every target up, with at least 4 scrapes in the rate window."""
    up = query(port, f"count_over_time(up[{RATE_INTERVAL}])")
    return len(up) == targets and all(float(s["value"][1]) >= 4 for s in up)


def check_dashboard(port: int, model: str, work: Path, traffic) -> None:
    """Prometheus (skipped, with the reason, where there is none) scraping the server on
    ``port`` serving ``model`` and the toy engines' exporters while ``traffic()`` runs,
    then every dashboard query evaluated (:func:`evaluate_dashboard`)."""
    binary = shutil.which("prometheus")
    if binary is None:
        reason = "no prometheus binary: `make setup` installs Debian's where apt-get runs as root"
        print(reason)
        pytest.skip(reason)
    exporters = []
    for feature in ("mesh", "quality", "prediction", "host", "substitution", "low_bit"):
        config, inputs, *prepare = ENGINES[feature]
        after_call = judged_window if feature == "quality" else lambda engine: None
        if feature == "quality":  # (every row sampled; a window of one pass)
            config = {**config, "quality": {"sample": 1.0, "window": 1}}
        (work / feature).mkdir()
        page = scraped(work / feature, config, inputs(), model, after_call, *prepare)
        exporters.append(exporter(page))
    try:
        prometheus, prometheus_port = start_prometheus(
            binary, work, [port, *(p for p, _ in exporters)]
        )
        try:
            deadline = time.monotonic() + 120
            while True:  # traffic while it scrapes: the rates have something to show
                traffic()
                if scraped_enough(prometheus_port, 1 + len(exporters)):
                    break
                assert time.monotonic() < deadline, "prometheus did not scrape every target"
            evaluate_dashboard(prometheus_port, model)
        finally:
            prometheus.terminate()
            prometheus.wait(30)
    finally:
        for _, server in exporters:
            server.shutdown()


def evaluate_dashboard(port: int, model: str) -> None:
    board = dashboard()
    # The variables (Grafana's label_values, as its Prometheus source asks for them).
    for variable, match in (
        ("model_name", "specexpert_info"),
        ("engine", f'specexpert_info{{model_name="{model}"}}'),
    ):
        values = requests.get(
            f"http://127.0.0.1:{port}/api/v1/label/{variable}/values",
            params={"match[]": match},
            timeout=30,
        ).json()["data"]
        assert values, variable
        if variable == "model_name":
            assert model in values
    problems = []
    for panel in panels(board):
        for target in panel["targets"]:
            expr = (
                target["expr"]
                .replace("$model_name", model)
                .replace("$engine", ".*")
                .replace("$__rate_interval", RATE_INTERVAL)
            )
            expected = set(LEGEND.findall(target.get("legendFormat", "")))
            if panel["type"] == "table" and "specexpert_info" in expr:
                expected |= INFO_LABELS
            where = f"{panel['title']!r} {target['refId']}"
            result = query(port, expr)
            if not result:
                problems.append(f"{where}: no series ({expr})")
                continue
            missing = {
                label for series in result for label in expected if label not in series["metric"]
            }
            if missing:
                problems.append(f"{where}: series without {sorted(missing)} ({expr})")
    assert problems == [], "\n".join(problems)
