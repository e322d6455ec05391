"""A bounded soak of ``specexpert serve``: concurrent clients for a fixed time, watching
errors, throughput, latency, memory per process and the cache's residency.

    python benchmarks/soak.py [--minutes 10] [--clients 8] [--budget 0.25]
                              [--config '{"predictor": "quasi_hidden", ...}']

Starts the server on 127.0.0.1 only (the embedded model, ``fetch`` at ``--budget``
unless ``--config`` adds to it), then runs ``--clients`` threads that each loop: a
completion of a held-out prompt with a random length (``max_tokens`` 8-128, half of
them streamed). Every 30 s it samples the RSS of the server and each of its child
processes and the ``specexpert_resident_experts`` / ``specexpert_slots`` series of
``/metrics``. Prints a line per sample and a summary; writes
``benchmarks/results/soak.json``. Errors are any non-200 reply, a stream that ends
without ``[DONE]``, or a client exception; the soak fails (exit 1) on any.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, held_out_prompts, write_result

from vllm_specexpert.tools.embedded_model import TRAINED_MODEL_DIR
from vllm_specexpert.tools.server import start_server, wait_healthy


class Client(threading.Thread):
    """Loops completions until ``stop``; records latency and tokens per request."""

    def __init__(self, port: int, model: str, prompts: list[str], seed: int, stop: threading.Event):
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/v1/completions"
        self.model, self.prompts, self.stop = model, prompts, stop
        self.rng = random.Random(seed)
        self.latencies: list[float] = []
        self.tokens = 0
        self.errors: list[str] = []

    def run(self) -> None:
        import requests

        while not self.stop.is_set():
            stream = self.rng.random() < 0.5
            body = {
                "model": self.model,
                "prompt": self.rng.choice(self.prompts),
                "max_tokens": self.rng.randint(8, 128),
                "temperature": 0.7,
                "seed": self.rng.randint(0, 2**31),
                "ignore_eos": True,
                "stream": stream,
            }
            if stream:
                body["stream_options"] = {"include_usage": True}
            started = time.perf_counter()
            try:
                reply = requests.post(self.url, json=body, timeout=600, stream=stream)
                if reply.status_code != 200:
                    self.errors.append(f"HTTP {reply.status_code}: {reply.text[:200]}")
                    continue
                tokens = self._read(reply, stream)
            except Exception as error:  # noqa: BLE001 - every failure is a soak error
                self.errors.append(f"{type(error).__name__}: {error}")
                continue
            if tokens is None:
                self.errors.append("stream ended without [DONE]")
                continue
            self.latencies.append(time.perf_counter() - started)
            self.tokens += tokens

    @staticmethod
    def _read(reply, stream: bool) -> int | None:
        if not stream:
            return reply.json()["usage"]["completion_tokens"]
        tokens, done = 0, False
        for line in reply.iter_lines():
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                break
            usage = json.loads(data).get("usage")
            if usage:
                tokens = usage["completion_tokens"]
        return tokens if done else None


def sample(server: subprocess.Popen, port: int) -> dict:
    """RSS (MB) of the server and each descendant, and residency from /metrics."""
    import psutil
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    root = psutil.Process(server.pid)
    rss = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            rss[f"{process.pid} {process.name()}"] = process.memory_info().rss / 2**20
        except psutil.Error:
            continue
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    resident = slots = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "specexpert_resident_experts":
                resident += s.value
            elif s.name == "specexpert_slots":
                slots += s.value
    return {"rss_mb": rss, "resident_experts": resident, "slots": slots}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--config", default="{}", help="more specexpert settings (JSON)")
    parser.add_argument("--port", type=int, default=8431)
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--name", default="soak")
    args = parser.parse_args()

    config = {"budget": args.budget, **json.loads(args.config)}
    log_path = Path("/tmp") / f"specexpert-soak-{args.port}.log"
    server = start_server(
        TRAINED_MODEL_DIR, args.port, log_path, config, ["--max-model-len", "512"]
    )
    samples = []
    try:
        wait_healthy(server, args.port, log_path)
        prompts = held_out_prompts(64)
        stop = threading.Event()
        clients = [
            Client(args.port, str(TRAINED_MODEL_DIR), prompts, seed, stop)
            for seed in range(args.clients)
        ]
        started = time.monotonic()
        for client in clients:
            client.start()
        while time.monotonic() - started < args.minutes * 60:
            time.sleep(
                min(args.sample_s, max(0.0, args.minutes * 60 - (time.monotonic() - started)))
            )
            now = {
                "t_s": round(time.monotonic() - started, 1),
                **sample(server, args.port),
                "tokens": sum(c.tokens for c in clients),
                "errors": sum(len(c.errors) for c in clients),
            }
            samples.append(now)
            print(
                json.dumps({**now, "rss_mb": {k: round(v) for k, v in now["rss_mb"].items()}}),
                flush=True,
            )
            if server.poll() is not None:
                break
        stop.set()
        for client in clients:
            client.join(timeout=600)
        elapsed = time.monotonic() - started
    finally:
        alive = server.poll() is None
        server.terminate()
        server.wait(timeout=120)
    latencies = sorted(latency for c in clients for latency in c.latencies)
    errors = [e for c in clients for e in c.errors]
    first, last = samples[0]["rss_mb"], samples[-1]["rss_mb"]
    result = {
        "config": config,
        "minutes": args.minutes,
        "clients": args.clients,
        "server_alive_at_end": alive,
        "requests": len(latencies),
        "errors": len(errors),
        "error_examples": errors[:5],
        "output_tok_s": sum(c.tokens for c in clients) / elapsed,
        "latency_p50_s": statistics.median(latencies) if latencies else None,
        "latency_p95_s": latencies[int(0.95 * (len(latencies) - 1))] if latencies else None,
        "rss_growth_mb": {k: round(last[k] - first[k], 1) for k in first if k in last},
        "samples": samples,
    }
    path = write_result(args.name, result)
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}\ncommand: {command_line()}")
    if errors or not alive:
        sys.exit(1)


if __name__ == "__main__":
    main()
