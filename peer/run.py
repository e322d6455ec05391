"""vLLM 0.32's own OpenAI-server tests against ``specexpert serve``, vanilla and offloaded.

    python peer/run.py [--modes vanilla offload] [--files PATH ...] [-k EXPR]

Fetches vLLM 0.32.0's source distribution from PyPI (checked against its sha256) into
``.peer-cache/``, applies ``peer/vllm-0.32.0-openai.patch`` (the test server runs
``specexpert serve`` and calls ``peer/specexpert_peer.py``, which serves the embedded
model under every hub name the tests use and caps the context length), then runs the same
test files once per mode:

- ``vanilla``: vLLM without the plugin;
- ``offload``: the plugin, every expert in the slow tier, a device cache of a quarter of
  them (``budget`` 0.25), on-demand ``fetch`` (exact) with the ``quasi_hidden`` predictor
  prefetching.

Some tests fail in both modes: they expect a particular hub model (its tokenizer, chat
template, LoRA adapters, exact texts, a multimodal model). The claim is parity: the set of
passing tests is the same in every mode. A test whose outcome differs is run again in
every mode: one whose outcome changes between its two runs in some mode is flaky (vLLM's
tests race on a tiny model, e.g. ``test_abort_metrics_reset``), reported but not a
difference; one that differs again, each mode repeating itself, is a difference. Prints
the counts, the flaky tests and every difference, writes
``benchmarks/results/peer.json``, and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".peer-cache"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/d5/df/"
    "5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz"
)
SDIST_SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
PATCH = REPO / "peer" / "vllm-0.32.0-openai.patch"
ASSETS = REPO / "vllm_specexpert" / "assets"
MODEL = ASSETS / "tiny-qwen3-moe"

# Completion (streamed or not, logprobs, echo, n > 1, stop strings, seeds, token ids),
# models, tokenization endpoints, error handling and request validation, metrics.
FILES = [
    "tests/entrypoints/openai/completion/test_completion.py",
    "tests/entrypoints/openai/completion/test_completion_error.py",
    "tests/entrypoints/openai/completion/test_completion_text_offset.py",
    "tests/entrypoints/openai/completion/test_prompt_validation.py",
    "tests/entrypoints/openai/models/test_models.py",
    "tests/entrypoints/openai/test_chunked_prompt.py",
    "tests/entrypoints/openai/test_return_token_ids.py",
    "tests/entrypoints/openai/test_return_tokens_as_ids.py",
    "tests/entrypoints/openai/test_session_id.py",
    "tests/entrypoints/openai/test_stop_token_ids.py",
    "tests/entrypoints/serve/exception_handling/test_validation_exception_handler.py",
    "tests/entrypoints/serve/instrumentator/test_basic.py",
    "tests/entrypoints/serve/instrumentator/test_metrics.py",
    "tests/entrypoints/serve/tokenize/test_tokenization.py",
]

SERVER_LINE_PREFIXES = ("(APIServer", "(EngineCore", "(Worker", "(VllmWorker", "INFO:", "WARNING")

MODES = {
    "vanilla": None,
    "offload": {
        "budget": 0.25,
        "miss_policy": "fetch",
        "predictor": "quasi_hidden",
        "calibration": str(ASSETS / "tiny-qwen3-moe-calibration"),
    },
}


def fetch_sources() -> Path:
    """vLLM's test tree, patched, under ``.peer-cache/vllm-0.32.0``."""
    CACHE.mkdir(exist_ok=True)
    sdist = CACHE / "vllm-0.32.0.tar.gz"
    if not sdist.exists():
        print(f"downloading {SDIST_URL}", flush=True)
        urllib.request.urlretrieve(SDIST_URL, sdist.with_suffix(".part"))
        sdist.with_suffix(".part").rename(sdist)
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        sdist.unlink()
        raise SystemExit(f"{sdist}: sha256 {digest}, expected {SDIST_SHA256}; removed, rerun")
    root = CACHE / "vllm-0.32.0"
    shutil.rmtree(root, ignore_errors=True)  # always a fresh tree, the patch applied once
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith("vllm-0.32.0/tests/") or m.name == "vllm-0.32.0/pyproject.toml"
        ]
        tar.extractall(CACHE, members=members, filter="data")
    subprocess.run(["patch", "-p1", "--quiet", "-i", str(PATCH)], cwd=root, check=True)
    return root


def run_mode(root: Path, mode: str, files: list[str], keyword: str | None, run: str = "") -> None:
    """Runs the tests of ``files`` (paths or node ids) in ``mode``: junit report and full
    log in the cache, named by ``mode`` and ``run`` (``""``: the first run)."""
    env = dict(
        os.environ,
        SPECEXPERT_PEER_MODEL=str(MODEL),
        SPECEXPERT_PEER_MAX_LEN="1024",
        PYTHONPATH=str(REPO / "peer"),
        HF_HUB_OFFLINE="1",
    )
    env.pop("VLLM_PLUGINS", None)
    if MODES[mode] is not None:
        env["SPECEXPERT_PEER_CONFIG"] = json.dumps(MODES[mode])
    else:
        env.pop("SPECEXPERT_PEER_CONFIG", None)
    # -s: the servers' logs pass through, to count which ran the plugin (report()).
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "specexpert_peer",
        "-q",
        "-s",
        "-rfE",
        "-p",
        "no:cacheprovider",
        f"--junitxml={CACHE / f'junit-{mode}{run}.xml'}",
        "--timeout=900",
        *files,
    ]
    if keyword:
        command += ["-k", keyword]
    print(f"\n=== {mode}: {' '.join(command)}", flush=True)
    with (
        subprocess.Popen(
            command,
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        ) as pytest,
        open(CACHE / f"pytest-{mode}{run}.log", "w") as log,
    ):
        for line in pytest.stdout:
            log.write(line)
            if not line.startswith(SERVER_LINE_PREFIXES):  # the servers' lines: log only
                print(line, end="", flush=True)


def report(mode: str, run: str = "") -> tuple[dict[str, str], int, int, float | None]:
    """Outcome (passed / failed / error / skipped) of every test id run in ``mode``, how
    many servers the tests started, how many of them offloaded MoE layers, and pytest's
    wall time."""
    outcomes = {}
    for case in ElementTree.parse(CACHE / f"junit-{mode}{run}.xml").iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        children = {child.tag for child in case}
        outcome = (
            "failed"
            if "failure" in children
            else "error"
            if "error" in children
            else "skipped"
            if "skipped" in children
            else "passed"
        )
        outcomes[test_id] = outcome
    log = (CACHE / f"pytest-{mode}{run}.log").read_text(errors="replace")
    seconds = re.findall(r" in ([0-9.]+)s", log)
    return (
        outcomes,
        log.count("Launching RemoteOpenAIServer with:"),
        log.count("MoE layers offloaded"),
        float(seconds[-1]) if seconds else None,
    )


def node_id(root: Path, test_id: str) -> str:
    """pytest's node id of a junit ``classname::name`` (``a.b.test_x.TestY::test_z[p]``
    -> ``a/b/test_x.py::TestY::test_z[p]``)."""
    classname, _, name = test_id.partition("::")
    parts = classname.split(".")
    for split in range(len(parts), 0, -1):
        path = Path(*parts[:split]).with_suffix(".py")
        if (root / path).exists():
            return "::".join([path.as_posix(), *parts[split:], name])
    raise ValueError(f"no test file for {test_id}")


def differences(results: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """Test id -> outcome per mode, for the tests whose outcomes differ between modes."""
    test_ids = sorted(set().union(*results.values()))
    return {
        t: {mode: results[mode].get(t, "absent") for mode in results}
        for t in test_ids
        if len({results[mode].get(t, "absent") for mode in results}) > 1
    }


def split_flaky(
    differing: dict[str, dict[str, str]], rerun: dict[str, dict[str, str]]
) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, list[str]]]]:
    """``differing`` (test id -> first outcome per mode) split, by the outcomes of a
    second run (mode -> test id -> outcome), into the differences that repeated in
    every mode and the flaky tests (test id -> mode -> both outcomes)."""
    kept, flaky = {}, {}
    for test_id, first in differing.items():
        runs = {
            mode: [outcome, rerun.get(mode, {}).get(test_id, "absent")]
            for mode, outcome in first.items()
        }
        if any(a != b for a, b in runs.values()):
            flaky[test_id] = runs
        else:
            kept[test_id] = first
    return kept, flaky


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--files", nargs="+", default=FILES)
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="summarize the last run's reports and logs, run nothing",
    )
    args = parser.parse_args()

    started = time.monotonic()
    if not args.report_only:
        root = fetch_sources()
        for mode in args.modes:
            run_mode(root, mode, args.files, args.keyword)
    results, servers = {}, {}
    for mode in args.modes:
        results[mode], started_servers, offloaded, seconds = report(mode)
        servers[mode] = {
            "started": started_servers,
            "offloaded": offloaded,
            "pytest_seconds": seconds,
        }
        print(f"{mode}: {started_servers} servers started, {offloaded} offloaded MoE layers")
    counts = {
        mode: {
            kind: sum(1 for o in outcomes.values() if o == kind)
            for kind in ("passed", "failed", "error", "skipped")
        }
        for mode, outcomes in results.items()
    }
    test_ids = sorted(set().union(*results.values()))
    differing = differences(results)
    flaky: dict[str, dict[str, list[str]]] = {}
    if differing and not args.report_only:
        # Once more, every differing test in every mode: a difference must repeat.
        again = [node_id(root, t) for t in differing]
        for mode in args.modes:
            run_mode(root, mode, again, None, run="-again")
        differing, flaky = split_flaky(
            differing, {mode: report(mode, "-again")[0] for mode in args.modes}
        )

    print(f"\n{len(args.files)} files, {len(test_ids)} tests")
    for mode, count in counts.items():
        print(f"  {mode:8s} " + "  ".join(f"{k} {v}" for k, v in count.items()))
    for test_id, runs in flaky.items():
        print(f"  FLAKY {test_id} (two runs per mode): {runs}")
    for test_id, outcome in differing.items():
        print(f"  DIFFERS {test_id}: {outcome}")
    command = "python peer/run.py " + " ".join(a for a in sys.argv[1:] if a != "--report-only")
    result = {
        "command": command.strip(),
        "files": args.files,
        "modes": MODES,
        "counts": counts,
        "servers": servers,
        "differing": differing,
        "flaky": flaky,
        "outcomes": results,
        "minutes": None if args.report_only else round((time.monotonic() - started) / 60, 1),
    }
    out = REPO / "benchmarks" / "results" / "peer.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}\n{command}")
    if differing:
        print("FAIL: the outcomes differ between modes")
        sys.exit(1)
    for mode, count in servers.items():
        # Each server must have had the plugin on (offload) or off (vanilla).
        wanted = count["started"] if MODES[mode] is not None else 0
        if count["started"] == 0 or count["offloaded"] != wanted:
            print(
                f"FAIL: {mode}: {count['offloaded']} of {count['started']} servers "
                "offloaded MoE layers"
            )
            sys.exit(1)
    if not any(count["passed"] for count in counts.values()):
        print("FAIL: no test passed")
        sys.exit(1)


if __name__ == "__main__":
    main()
