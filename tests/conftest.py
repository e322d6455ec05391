import os
import sys
from pathlib import Path

# Engine tests run vLLM's CPU build on a small machine.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engine core in this process: LLM.generate then queues every prompt before the first
# step, so batch composition never depends on timing. With a separate engine-core process
# the first step can start before all prompts arrive, and on a loaded machine DeepSeek's
# MLA path then gives different (vanilla-vs-vanilla) results.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Lets tests inspect worker-side modules with LLM.apply_model.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

sys.path.insert(0, str(Path(__file__).parent))
# The test bed (specexpert_testbed) is imported from the repository, not installed, here
# and in the processes the tests start (reference runs, servers). Last on the path: a
# copy of the package given first (test_adding_a_feature) stays the one imported.
REPOSITORY = str(Path(__file__).parent.parent)
sys.path.append(REPOSITORY)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (os.environ.get("PYTHONPATH"), REPOSITORY) if p
)

# Triton-interpreter tests need TRITON_INTERPRET=1 from the start of their process;
# tests/test_triton_kernels.py runs them in a subprocess.
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interpreted"]


import pytest  # noqa: E402


@pytest.fixture
def host_reads(monkeypatch):
    """Names of the host reads of tensors (``.cpu/.numpy/.item/.tolist``) made from now
    on; on CUDA each one would synchronize with the compute stream. Clear it to count
    from a later point."""
    import torch

    reads: list[str] = []
    for method in ("cpu", "numpy", "item", "tolist"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _name=method, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    return reads


@pytest.fixture
def toy_engines():
    """``toy_engine.build_engine`` for one test: the same arguments, the same engine, and
    every engine it built is closed when the test ends, passed or failed (its link's copy
    thread, its stats writer, its features' peers; closing twice is harmless, so a test
    may close one itself). Each test file's toy model is a fixture on this one."""
    from toy_engine import closing_engines

    with closing_engines() as build:
        yield build


def cpu_line() -> str:
    """The CPU features the engine tests ran on: vLLM's CPU MoE kernel (the engine's and
    the mesh peers') takes AMX where the CPU has it, and results differ between them."""
    import torch

    amx = torch.cpu._is_amx_tile_supported()
    return (
        f"cpu: torch capability {torch.backends.cpu.get_cpu_capability()}, AMX tiles "
        f"{'yes' if amx else 'no'}; vLLM's CPU MoE kernel ISA: {'amx' if amx else 'vec'}"
    )


def pytest_report_header(config) -> str:
    return cpu_line()


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(cpu_line())  # (also under -q, which drops the header)
