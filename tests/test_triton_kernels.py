"""The plugin's Triton kernels: correctness under the interpreter (tests/interpreted, in a
subprocess with TRITON_INTERPRET=1) and ahead-of-time compilation for sm_80 and sm_90,
which needs no GPU. Neither runs a kernel on a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from triton_aot import (
    ARCHITECTURES,
    SPECIALIZATIONS,
    compile_for,
    resource_usage,
)

TESTS = Path(__file__).parent


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def test_kernels_match_their_references_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(TESTS / "interpreted"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(result.stdout[-3000:], result.stderr[-3000:])
    assert result.returncode == 0, "interpreted kernel tests failed (output above)"
    assert " passed" in result.stdout and "skipped" not in result.stdout


@pytest.fixture(scope="module", autouse=True)
def triton_cache(tmp_path_factory):
    """Compile into a fresh cache, so that every test really runs ptxas."""
    saved = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    yield
    if saved is None:
        os.environ.pop("TRITON_CACHE_DIR")
    else:
        os.environ["TRITON_CACHE_DIR"] = saved


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("specialization", SPECIALIZATIONS, ids=lambda s: s.name)
def test_kernel_compiles_for_nvidia_target_without_spilling(specialization, arch):
    compiled = compile_for(specialization, arch)
    targets = [line for line in compiled.asm["ptx"].splitlines() if line.startswith(".target")]
    assert targets and targets[0].split()[1].startswith(f"sm_{arch}")
    assert compiled.asm["cubin"][:4] == b"\x7fELF"
    usage = resource_usage(compiled)
    print(specialization.name, f"sm_{arch}", usage)
    # A kernel that needs more registers than ptxas gives it spills to local memory
    # (stack): on the decode path, a slow kernel. (Registers per thread are capped by
    # the hardware, so their count alone cannot fail.)
    assert usage["STACK"] == 0, f"registers spill: {usage}"


@pytest.mark.skipif(
    _cuda_available(),
    reason="this machine has CUDA: `make gpu-check` runs the real check here instead of refusing",
)
def test_gpu_check_refuses_a_machine_without_cuda():
    """`make gpu-check` is meant for a CUDA machine; here it must say why it cannot run
    (exit 2), not fail somewhere inside vLLM."""
    script = TESTS.parent / "benchmarks" / "gpu_check.py"
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "gpu-check needs a CUDA machine" in result.stderr
