"""``specexpert serve`` as a child process on 127.0.0.1, for the server test, the soak
and the peer suites: start it with the plugin's config (or vanilla), wait until
``/health`` answers, stop it."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

SPECEXPERT = [sys.executable, "-m", "vllm_specexpert.cli"]
"""The ``specexpert`` command of this interpreter."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model: str | Path,
    port: int,
    log_path: Path,
    config: dict | None = None,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """``specexpert serve model`` on 127.0.0.1:``port``, output to ``log_path``; with
    ``--plugins specexpert`` and ``config`` as ``additional_config["specexpert"]``, or
    vanilla vLLM if ``config`` is None. ``env``: the server's environment (default:
    this process's)."""
    command = [*SPECEXPERT, "serve", str(model), "--host", "127.0.0.1", "--port", str(port), *args]
    if config is not None:
        command += [
            "--plugins",
            "specexpert",
            "--additional-config",
            json.dumps({"specexpert": config}),
        ]
    from vllm_specexpert import metrics

    # A new frontend: not the caller's metrics directory (an in-process LLM made one).
    env = {
        k: v
        for k, v in (os.environ if env is None else env).items()
        if k not in (metrics.DIRECTORY_ENV, metrics.MODEL_NAME_ENV)
    }
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_healthy(
    server: subprocess.Popen, port: int, log_path: Path, timeout_s: float = 600
) -> None:
    """Returns when ``/health`` answers 200; raises RuntimeError with the log's tail if
    the server exits or does not come up in ``timeout_s``."""
    import requests

    deadline = time.monotonic() + timeout_s
    while server.poll() is None:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok:
                return
        except requests.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"server did not come up in {timeout_s:.0f} s:\n"
                + Path(log_path).read_text()[-3000:]
            )
        time.sleep(1)
    raise RuntimeError("server exited:\n" + Path(log_path).read_text()[-3000:])


@contextlib.contextmanager
def serving(
    model: str | Path,
    port: int,
    log_path: Path,
    config: dict | None = None,
    args: Sequence[str] = (),
    timeout_s: float = 600,
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen]:
    """The server of :func:`start_server`, healthy, for the ``with`` block; then stopped
    (SIGTERM, as an operator or a supervisor stops it)."""
    server = start_server(model, port, log_path, config, args, env)
    try:
        wait_healthy(server, port, log_path, timeout_s)
        yield server
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
