"""`specexpert demo` as a new user runs it: the plugin's summary, the samples and the
comparison with vanilla on the terminal, vLLM's logs in a file, offloaded tokens equal
to vanilla's (the demo exits 1 otherwise)."""

import os
import re
import subprocess
import sys

import pytest

from vllm_specexpert.tools.demo import PROMPTS


@pytest.mark.slow  # (`make demo` runs it; the engine paths it takes are the exactness tests)
def test_demo_prints_samples_and_an_exact_comparison_without_vllm_logs(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as from a shell
    result = subprocess.run(
        [sys.executable, "-m", "vllm_specexpert.cli", "demo", "--max-tokens", "24"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(result.stdout, result.stderr[-3000:])
    assert result.returncode == 0
    out = result.stdout + result.stderr
    for prompt in PROMPTS:
        assert f"--- {prompt!r}" in out
    assert re.search(r"greedy tokens identical: (\d+)/\1 ", out), "offloaded != vanilla"
    assert "mode output: exact" in out
    # vLLM's own lines ("INFO 11-23 ...", "WARNING ...", platform checks) went to the log.
    assert not re.search(r"\b(INFO|WARNING|DEBUG)\b", out)
    assert "Triton" not in out
    log = tmp_path / "specexpert-demo.log"
    assert "INFO" in log.read_text()
