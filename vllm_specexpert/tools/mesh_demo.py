"""``make mesh-demo``: the embedded model served with its experts on two Ray peers across
a real network delay, then the per-peer stats.

Starts a Ray cluster on this machine (:mod:`vllm_specexpert.tools.mesh_cluster`: a head in
the root network namespace, each peer in a namespace of its own behind a forwarder that
delays packets, ``--rtt-ms`` round trip), serves the embedded model with ``specexpert
serve`` and ``mesh`` pointing at that cluster, sends a few completions through the OpenAI
API, prints each peer's counters from the stats file, and removes everything it made.
Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from vllm_specexpert.tools.arguments import non_negative_float, positive_int
from vllm_specexpert.tools.embedded_model import TRAINED_CALIBRATION_DIR, TRAINED_MODEL_DIR
from vllm_specexpert.tools.mesh_cluster import MeshCluster
from vllm_specexpert.tools.server import free_port, serving

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef walk(path):\n",
    "class Stack:\n",
    "def read_json(path):\n",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", type=positive_int, default=2)
    parser.add_argument(
        "--rtt-ms", type=non_negative_float, default=5.0, help="round trip to each peer"
    )
    parser.add_argument("--mode", choices=["sync", "early_fire", "no_stop"], default="sync")
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--max-tokens", type=positive_int, default=32)


def run(args: argparse.Namespace) -> None:
    from vllm_specexpert.config import SpecExpertConfig

    SpecExpertConfig.from_dict({"budget": args.budget})  # its own error, before any work
    if os.geteuid() != 0:
        raise SystemExit("mesh-demo makes network namespaces: run it as root")
    with (
        MeshCluster(peers=args.peers, rtt_ms=args.rtt_ms) as cluster,
        tempfile.TemporaryDirectory(prefix="specexpert-mesh-") as tmp,
    ):
        print(
            f"Ray cluster: head {cluster.address}, {args.peers} peers in network "
            f"namespaces, measured round trip {cluster.measure_rtt()} ms",
            flush=True,
        )
        stats_path = Path(tmp) / "stats.json"
        config = {
            "budget": args.budget,
            "stats_path": str(stats_path),
            "stats_interval_s": 0.5,
            "mesh": {"ray_address": cluster.address, "peers": args.peers, "mode": args.mode},
        }
        if args.mode != "sync":
            config.update(predictor="quasi_hidden", calibration=str(TRAINED_CALIBRATION_DIR))
        env = {**os.environ, **cluster.env, "VLLM_CPU_KVCACHE_SPACE": "1"}
        port, log = free_port(), Path(tmp) / "server.log"
        print(f"serving the embedded model with {json.dumps(config['mesh'])} ...", flush=True)
        with serving(
            TRAINED_MODEL_DIR,
            port,
            log,
            config,
            ["--enforce-eager", "--max-model-len", "512"],
            env=env,
        ):
            started = time.perf_counter()
            texts = complete(port, args.max_tokens)
            seconds = time.perf_counter() - started
            for prompt, text in zip(PROMPTS, texts, strict=True):
                print(f"--- {prompt!r} -> {text!r}")
            print(f"{len(PROMPTS)} completions of {args.max_tokens} tokens in {seconds:.1f} s")
            time.sleep(1.0)  # the next periodic write of the stats file
            report(json.loads(stats_path.read_text()))


def complete(port: int, max_tokens: int) -> list[str]:
    import concurrent.futures

    import requests

    def one(prompt: str) -> str:
        reply = requests.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=600,
            json={
                "model": str(TRAINED_MODEL_DIR),
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        )
        reply.raise_for_status()
        return reply.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def report(stats: dict) -> None:
    decode = stats["total"]["decode"]
    print(f"\n{stats['summary']}")
    print(
        f"decode: {decode['missed_entries']} missed entries, {decode['peer_entries']} "
        f"computed by peers, {decode['peer_fallback_entries']} fell back here, "
        f"{decode['fired_used']}/{decode['fired_entries']} fired ahead and used"
    )
    print(
        f"{'peer':>4} {'up':>3} {'rtt ms':>7} {'calls':>6} {'pairs':>6} {'kB sent':>8} "
        f"{'kB back':>8} {'compute ms':>10} {'call ms':>8}  node"
    )
    for p in stats["mesh"]["peers"]:
        rtt = f"{p['rtt_ms']:.2f}" if p["rtt_ms"] is not None else "-"
        print(
            f"{p['rank']:>4} {'yes' if p['up'] else 'no':>3} {rtt:>7} {p['calls']:>6} "
            f"{p['pairs']:>6} {p['bytes_sent'] / 1e3:>8.1f} {p['bytes_received'] / 1e3:>8.1f} "
            f"{p['compute_s'] * 1e3:>10.1f} {p['call_s'] * 1e3:>8.1f}  {p['node'][:12]}"
        )
