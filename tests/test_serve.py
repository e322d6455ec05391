"""`specexpert serve` (vllm serve on the CPU build) and `vllm bench throughput` with
offloading on."""

import json
import os
import subprocess

import pytest
import requests
from vllm_harness import MAX_TOKENS, PROMPTS

from specexpert_testbed.fixtures import ensure_model
from vllm_specexpert.tools.embedded_model import (
    TRAINED_ANALYSIS_DIR,
    TRAINED_CALIBRATION_DIR,
    TRAINED_ESTIMATOR_DIR,
    TRAINED_MODEL_DIR,
)
from vllm_specexpert.tools.server import SPECEXPERT, free_port, serving

DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}
"""The server's environment adds this: vLLM's ``/collective_rpc``, for :func:`flush_stats`."""


def offload_config(stats_path, **extra) -> dict:
    # An hour: the worker's timer never rewrites the file during a test; the tests
    # write it with flush_stats (and the engine's close writes it once more).
    return {"budget": 0.25, "stats_path": str(stats_path), "stats_interval_s": 3600, **extra}


def test_serve_answers_completions_with_offloading_and_speculation(tmp_path):
    """The embedded model served with Hybrid-PF prediction (the estimator after some
    layers, quasi_hidden after the others), speculative execution and the router-free
    path: the whole engine behind vLLM's OpenAI server."""
    model = str(TRAINED_MODEL_DIR)
    stats_path = tmp_path / "stats.json"
    config = offload_config(
        stats_path,
        predictor="hybrid",
        miss_policy="speculate",
        router_free=True,
        calibration=str(TRAINED_CALIBRATION_DIR),
        estimator=str(TRAINED_ESTIMATOR_DIR),
        analysis=str(TRAINED_ANALYSIS_DIR),
    )
    port = free_port()
    temp = tmp_path / "tmp"  # the server's TMPDIR, to count what it leaves there
    temp.mkdir()
    with serving(
        model,
        port,
        tmp_path / "server.log",
        config,
        ["--enforce-eager", "--max-model-len", "512"],
        timeout_s=300,
        env={**os.environ, **DEV_MODE, "TMPDIR": str(temp)},
    ):
        assert metrics_directories(temp)  # where the workers' snapshots go
        body = complete(port, model, "def main():", 16)
        assert body["usage"]["completion_tokens"] == 16
        assert body["choices"][0]["text"]
        stats = flush_stats(port)
        assert json.loads(stats_path.read_text()) == stats
        # 16 tokens: the first from the prompt's prefill pass, 15 from decode passes.
        assert stats["decode_tokens"] == 15
        assert stats["total"]["prefill"]["misses"] > 0 and stats["link"]["bytes"] > 0
        assert stats["output"] == "approximate"
        decode = stats["total"]["decode"]
        # Layers after the estimator's skipped their router; quasi_hidden's did not.
        assert decode["speculated_calls"] > decode["router_free_calls"] > 0
        check_metrics_match_stats(port, stats_path, model)
    # Issue 22 (5): every start used to leave its snapshot directory behind.
    assert metrics_directories(temp) == []


@pytest.mark.slow  # (lowbit's label and counters are checked in LLM() by test_lowbit)
def test_serve_runs_lowbit_and_labels_it_approximate(tmp_path):
    """``lowbit`` behind the OpenAI server: INT4 copies made at load, run on misses,
    and the mode labelled approximate in the stats and on /metrics."""
    model = str(TRAINED_MODEL_DIR)
    stats_path = tmp_path / "stats.json"
    port = free_port()
    with serving(
        model,
        port,
        tmp_path / "server.log",
        offload_config(stats_path, miss_policy="lowbit"),
        ["--enforce-eager", "--max-model-len", "512"],
        timeout_s=300,
        env={**os.environ, **DEV_MODE},
    ):
        complete(port, model, "import os\nimport sys\n", 24)
        flush_stats(port)  # between passes: every layer of the last one counted
        stats = json.loads(stats_path.read_text())
        assert stats["decode_tokens"] == 23
        assert stats["output"] == "approximate" and stats["miss_policy"] == "lowbit"
        assert stats["total"]["decode"]["low_bit_entries"] > 0
        metrics = scrape(port)
        low_bit = sum(v for k, v in metrics.items() if k[0] == "specexpert_low_bit_entries_total")
        assert low_bit == stats["total"]["decode"]["low_bit_entries"], sorted(
            {k[0] for k in metrics}
        )
        info = [dict(k[1]) for k in metrics if k[0] == "specexpert_info"]
        assert [(i["miss_policy"], i["output"]) for i in info] == [("lowbit", "approximate")]


# (lookahead's stats in LLM() are test_lookahead's; this is them behind the server)
@pytest.mark.slow
def test_serve_runs_lookahead_and_reports_its_draft_lengths(tmp_path):
    """``lookahead`` behind the OpenAI server: the plugin sets vLLM's speculative
    decoding, the INT4 draft drafts, and /metrics shows the governor's counters."""
    model = str(TRAINED_MODEL_DIR)
    stats_path = tmp_path / "stats.json"
    port = free_port()
    with serving(
        model,
        port,
        tmp_path / "server.log",
        # (a fixed length: the governor drafts nothing in a run this short)
        offload_config(stats_path, lookahead={"k_max": 2, "k": 2}),
        ["--enforce-eager", "--max-model-len", "512"],
        timeout_s=300,
        env={**os.environ, **DEV_MODE},
    ):
        body = complete(port, model, "import os\nimport sys\n", 24)
        assert body["usage"]["completion_tokens"] == 24
        flush_stats(port)
        stats = json.loads(stats_path.read_text())
        metrics = scrape(port)
        drafted = sum(
            v for k, v in metrics.items() if k[0] == "specexpert_lookahead_drafted_tokens_total"
        )
        lookahead = stats["lookahead"]
        assert lookahead["k_max"] == 2 and lookahead["drafted"] > 0
        assert drafted == lookahead["drafted"]
        steps = {
            dict(k[1])["k"]: v
            for k, v in metrics.items()
            if k[0] == "specexpert_lookahead_steps_total"
        }
        assert steps == {k: float(n) for k, n in lookahead["steps_by_k"].items()}
        assert stats["output"] == "exact"


@pytest.fixture(scope="module")
def disk_server(tmp_path_factory):
    """The embedded model served from the disk tier (its pack made at the start):
    ``(port, model, pack directory, work directory)``."""
    work = tmp_path_factory.mktemp("disk-server")
    model = str(TRAINED_MODEL_DIR)
    port = free_port()
    with serving(
        model,
        port,
        work / "server.log",
        {"budget": 0.25, "disk": {"path": str(work / "pack"), "residency": "slots"}},
        ["--enforce-eager", "--max-model-len", "512"],
        timeout_s=300,
        env={**os.environ, **DEV_MODE},
    ):
        yield port, model, work / "pack", work


# Slow: a server of its own, 54 s; LLM() checks the same in test_disk_tier's read-error tests.
@pytest.mark.slow
def test_serve_fails_only_the_requests_whose_records_are_corrupt(disk_server):
    """The disk tier behind the OpenAI server: records corrupted on disk after they were
    read fail the requests that read them again (an error response, never another text),
    the server stays up, and once the file is restored every answer is as before."""
    from vllm_specexpert.tiers.expert_pack import RECORDS_FILE, ExpertPack

    port, model, pack_dir, _ = disk_server
    prompts = [*PROMPTS, "for i in range(", "while True:\n    ", "x = [", "return "]
    before = [complete(port, model, p, MAX_TOKENS)["choices"][0]["text"] for p in prompts]
    # Two records of a middle layer. The requests above read most of the layer's records
    # already: a long prompt's prefill needs more of them than 16 slots hold.
    layer = ExpertPack(pack_dir).layers["model.layers.4.mlp.experts"]
    records = pack_dir / RECORDS_FILE
    saved = records.read_bytes()
    with open(records, "r+b") as f:
        for expert in (5, 37):
            w13 = layer.tensors[0]
            f.seek(w13.at(expert) + w13.nbytes // 2)
            f.write(os.urandom(4096))
    try:  # (the pack is the module's server's: whole again whatever happens here)
        answers = [post(port, model, p) for p in prompts]
        failed = [a.status_code != 200 for a in answers]
        print(f"corrupt: {sum(failed)} of {len(prompts)} requests failed")
        assert any(failed), "no request read a corrupt record"
        for answer, text in zip(answers, before, strict=True):
            if answer.status_code == 200:  # never another text
                assert answer.json()["choices"][0]["text"] == text
        assert requests.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        flush_stats(port)  # the /metrics snapshot, now
        failures = scrape(port)
        assert sum(v for k, v in failures.items() if k[0] == "specexpert_disk_failed_total") > 0
    finally:
        records.write_bytes(saved)
    after = [complete(port, model, p, MAX_TOKENS)["choices"][0]["text"] for p in prompts]
    assert after == before


# Slow: the corrupt-records test's server; the series are checked against the counters in
# test_metrics.
@pytest.mark.slow
def test_every_dashboard_query_returns_series_with_its_panels_labels(disk_server):
    """A real Prometheus scrapes the server (``tests/prometheus_check.py``): every query
    of ``docs/grafana/specexpert.json`` returns series with its legend's labels."""
    from prometheus_check import check_dashboard

    port, model, _, work = disk_server
    check_dashboard(port, model, work, lambda: complete(port, model, "def main():", 8))


def post(port: int, model: str, prompt: str) -> requests.Response:
    return requests.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=120,
    )


def complete(port: int, model: str, prompt: str, max_tokens: int) -> dict:
    """A greedy completion from the server (asserted to succeed)."""
    response = requests.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()


def flush_stats(port: int) -> dict:
    """The worker's stats, with the stats file and the /metrics snapshot written before
    this returns: ``specexpert_stats`` through vLLM's ``/collective_rpc`` (the server
    started with :data:`DEV_MODE`). The engine core runs it between passes."""
    response = requests.post(
        f"http://127.0.0.1:{port}/collective_rpc",
        json={"method": "specexpert_stats", "timeout": 60},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    [stats] = response.json()["results"]  # one worker
    return stats


def metrics_directories(root) -> list[str]:
    from vllm_specexpert.metrics import DIRECTORY_PREFIX

    return [p.name for p in root.iterdir() if p.name.startswith(DIRECTORY_PREFIX)]


def scrape(port: int) -> dict[tuple, float]:
    """``/metrics`` as ``{(name, sorted labels): value}`` for the specexpert series."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("specexpert_")
    }


def check_metrics_match_stats(port: int, stats_path, model: str) -> None:
    """After traffic, the scraped series equal the worker's own stats (stats_path),
    layer by layer and phase by phase (both written by :func:`flush_stats`)."""
    flush_stats(port)
    stats = json.loads(stats_path.read_text())
    metrics = scrape(port)
    expected = {}
    for name, layer in stats["layers"].items():
        index = str(stats["layer_index"][name])
        for phase in ("decode", "prefill"):
            base = {"model_name": model, "engine": "0", "layer": index, "phase": phase}
            for field, metric in (
                ("hits", "hits"),
                ("misses", "misses"),
                ("bytes_loaded", "bytes_loaded"),
                ("speculated_calls", "speculated_calls"),
                ("stall_s", "stall_seconds"),
            ):
                key = (f"specexpert_{metric}_total", tuple(sorted(base.items())))
                expected[key] = layer[phase][field]
        key = (
            "specexpert_resident_experts",
            tuple(sorted({"model_name": model, "engine": "0", "layer": index}.items())),
        )
        expected[key] = stats["resident_per_layer"][name]
    for part in ("slots", "room", "kv", "workspace", "reserve", "space"):
        labels = {"model_name": model, "engine": "0", "part": part}
        key = ("specexpert_budget_bytes", tuple(sorted(labels.items())))
        expected[key] = stats["budget"]["slot_bytes" if part == "slots" else f"{part}_bytes"]
    found = {k: metrics.get(k) for k in expected}
    assert found == expected
    assert sum(v for k, v in expected.items() if k[0] == "specexpert_hits_total") > 0
    info = [k for k in metrics if k[0] == "specexpert_info"]
    assert [dict(k[1])["miss_policy"] for k in info] == ["speculate"]


def test_bench_throughput_runs_with_the_plugin(tmp_path):
    model = str(ensure_model("qwen3_moe"))
    stats_path = tmp_path / "stats.json"
    result_path = tmp_path / "throughput.json"
    proc = subprocess.run(
        [
            *SPECEXPERT,
            "vllm",
            "bench",
            "throughput",
            "--model",
            model,
            "--dataset-name",
            "random",
            "--random-input-len",
            "32",
            "--random-output-len",
            "16",
            "--num-prompts",
            "8",
            "--enforce-eager",
            "--max-model-len",
            "512",
            "--additional-config",
            json.dumps({"specexpert": offload_config(stats_path)}),
            "--output-json",
            str(result_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(result_path.read_text())
    assert result["num_requests"] == 8 and result["requests_per_second"] > 0
    stats = json.loads(stats_path.read_text())
    assert stats["total"]["prefill"]["misses"] > 0 and stats["decode_tokens"] > 0


def test_cli_reports_a_bad_config_in_one_line(tmp_path):
    model = str(ensure_model("qwen3_moe"))
    proc = subprocess.run(
        [
            *SPECEXPERT,
            "serve",
            model,
            "--additional-config",
            json.dumps({"specexpert": {"budget": 0.1}}),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 2
    assert "error: specexpert config: field 'budget'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "EngineCore" not in proc.stderr + proc.stdout  # no engine was started
    assert metrics_directories(tmp_path) == []  # issue 22 (5): a failed start left one
