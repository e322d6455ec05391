"""The runtime (what ``vllm serve`` loads through the plugin) imports nothing from the
tools (training, corpus, fixtures, harness, offline passes, demo)."""

import ast
import subprocess
import sys
from pathlib import Path

import vllm_specexpert

PACKAGE = Path(vllm_specexpert.__file__).parent
TOOLS = "vllm_specexpert.tools"
ENTRY_POINTS = {"cli.py"}
"""The ``specexpert`` command dispatches to tools by name, lazily; it is not the runtime."""


def runtime_modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if "tools" not in p.relative_to(PACKAGE).parts
            and p.relative_to(PACKAGE).as_posix() not in ENTRY_POINTS]


def imported_names(path: Path) -> set[str]:
    """Every module an ``import`` statement in ``path`` names, at any depth (function-
    level imports included), with relative imports resolved."""
    module = ".".join(("vllm_specexpert", *path.relative_to(PACKAGE).with_suffix("").parts))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_no_runtime_module_imports_the_tools():
    modules = runtime_modules()
    assert PACKAGE / "engine.py" in modules and PACKAGE / "layers" / "routed_experts.py" in modules
    offenders = {
        path.relative_to(PACKAGE).as_posix(): sorted(n for n in imported_names(path)
                                                     if n == TOOLS or n.startswith(TOOLS + "."))
        for path in modules
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_check_sees_function_level_and_relative_imports(tmp_path):
    """The scanner would catch the imports the runtime must not have."""
    fake = PACKAGE / "layers" / "_layout_probe.py"
    try:
        fake.write_text("def f():\n    from ..tools import fixtures\n    import vllm_specexpert.tools.corpus\n")
        names = imported_names(fake)
    finally:
        fake.unlink()
    assert "vllm_specexpert.tools.fixtures" in names and "vllm_specexpert.tools.corpus" in names


def test_loading_the_plugin_loads_no_tool():
    code = (
        "import sys\n"
        "from vllm_specexpert.plugins import register\n"
        "register()\n"
        "import vllm_specexpert.layers.routed_experts, vllm_specexpert.layers.model_classes\n"
        "import vllm_specexpert.worker, vllm_specexpert.engine\n"
        f"print(sorted(m for m in sys.modules if m.startswith('{TOOLS}')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
