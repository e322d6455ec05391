"""The package's structure stays what its relation map (``vllm_specexpert/__init__.py``)
says: every module is named there with its layer, no module imports from a layer above
its own, there is no import cycle (function-level imports counted; imports under
``if TYPE_CHECKING:`` are never executed and are left out), and the runtime (what
``vllm serve`` loads through the plugin) imports nothing from the tools nor from the test
bed (``specexpert_testbed``, outside the package). A module's length follows from the one
concept it holds: no line count is enforced."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import specexpert_testbed
import vllm_specexpert

PACKAGE = Path(vllm_specexpert.__file__).parent
ROOT = "vllm_specexpert"
TOOLS = f"{ROOT}.tools"
TESTBED = specexpert_testbed.__name__


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((ROOT, *parts))


def modules() -> dict[str, Path]:
    """Every module of the package by name (tools included), assets left out."""
    return {
        module_name(p): p
        for p in sorted(PACKAGE.rglob("*.py"))
        if "assets" not in p.relative_to(PACKAGE).parts
    }


def the_testbed_modules() -> set[str]:
    """The test bed's modules by name (it is flat: one directory)."""
    directory = Path(specexpert_testbed.__file__).parent
    return {TESTBED} | {
        f"{TESTBED}.{p.stem}" for p in directory.glob("*.py") if p.stem != "__init__"
    }


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imports_of(module: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules that ``module`` imports, at any depth (function-level
    included, ``TYPE_CHECKING`` blocks excluded), relative imports resolved. ``from X
    import Y`` is an import of ``X.Y`` where that is a module, else of ``X``."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.add(name if name in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return {name for name in found if name in known and name != module}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {
        name: imports_of(name, path.read_text(), path.name == "__init__.py", known)
        for name, path in found.items()
    }


def relation_map() -> dict[str, tuple[int, str]]:
    """The package docstring's map: top-level entry (``config/``, ``engine``) -> (layer,
    its line with continuation lines)."""
    entries: dict[str, tuple[int, str]] = {}
    current = None
    for line in (vllm_specexpert.__doc__ or "").splitlines():
        match = re.match(r"^    ([ \d]\d)  (\S+)\s+(.*)$", line)
        if match:
            current = match.group(2)
            entries[current] = (int(match.group(1)), match.group(3))
        elif current and re.match(r"^ {24}\S", line):
            layer, text = entries[current]
            entries[current] = (layer, f"{text} {line.strip()}")
        elif not line.strip():
            current = None
    return entries


def entry_of(module: str) -> str:
    """``module``'s top-level entry in the map (``tiers/`` for ``vllm_specexpert.tiers.cache``)."""
    parts = module.split(".")[1:] or ["__init__"]
    return parts[0] + ("/" if len(parts) > 1 or (PACKAGE / parts[0]).is_dir() else "")


def layer_of(module: str, entries: dict[str, tuple[int, str]]) -> int:
    """The layer of ``module``: that of its top-level entry in the map."""
    return entries[entry_of(module)][0]


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each map entry's floor in ``graph`` with packages counted as one: 1 if it imports
    no other entry, else one above the highest it imports."""
    imports: dict[str, set[str]] = {}
    for source, targets in graph.items():
        entry = entry_of(source)
        imports.setdefault(entry, set()).update(entry_of(t) for t in targets)
        imports[entry].discard(entry)
    found: dict[str, int] = {}

    def floor(entry: str) -> int:
        if entry not in found:
            found[entry] = 1 + max((floor(t) for t in imports.get(entry, ())), default=0)
        return found[entry]

    return {entry: floor(entry) for entry in imports}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import():
    graph = import_graph()
    graph[f"{ROOT}.config.modes"] = graph[f"{ROOT}.config.modes"] | {f"{ROOT}.engine"}
    assert any(f"{ROOT}.engine" in c and f"{ROOT}.config.modes" in c for c in cycles(graph))
    source = "def f():\n    from vllm_specexpert import engine\n"
    assert imports_of(f"{ROOT}.config.modes", source, False, set(graph)) == {f"{ROOT}.engine"}


def test_every_runtime_module_is_in_the_relation_map():
    entries = relation_map()
    missing = []
    for module in modules():
        parts = module.split(".")[1:] or ["__init__"]
        try:
            layer_of(module, entries)
        except KeyError:
            missing.append(module)
            continue
        if len(parts) > 1 and not module.startswith(TOOLS):
            # A runtime package's module: named in its package's line.
            top = parts[0] + "/"
            words = set(re.findall(r"[\w]+/?", entries[top][1]))
            if any(
                part != "__init__" and part not in words and f"{part}/" not in words
                for part in parts[1:]
            ):
                missing.append(module)
    assert missing == []


def test_the_map_check_sees_a_module_left_out(tmp_path):
    entries = relation_map()
    entries.pop("handoff")
    try:
        layer_of(f"{ROOT}.handoff", entries)
    except KeyError:
        return
    raise AssertionError("a module left out of the map was not noticed")


def test_no_module_imports_from_a_layer_above_its_own():
    entries = relation_map()
    upward = sorted(
        f"{source} ({layer_of(source, entries)}) -> {target} ({layer_of(target, entries)})"
        for source, targets in import_graph().items()
        for target in targets
        if layer_of(target, entries) > layer_of(source, entries)
    )
    assert upward == []


def test_each_layer_of_the_map_is_its_entrys_floor():
    """The map tells the truth: a module that starts importing from a higher layer (or
    stops) moves its entry, in the map too."""
    entries = relation_map()
    wrong = sorted(
        f"{entry}: map {entries[entry][0]}, floor {floor}"
        for entry, floor in floors(import_graph()).items()
        if entries[entry][0] != floor
    )
    assert wrong == []


def test_floors_count_a_package_as_one_and_follow_chains():
    graph = {
        f"{ROOT}.a": {f"{ROOT}.b"},
        f"{ROOT}.b": {f"{ROOT}.tiers.cache"},
        f"{ROOT}.tiers.cache": {f"{ROOT}.tiers.store"},  # inside one entry: no floor
        f"{ROOT}.tiers.store": set(),
    }
    assert floors(graph) == {"a": 3, "b": 2, "tiers/": 1}


def test_no_runtime_docstring_points_outside_the_repository():
    outside = [
        name
        for name, path in modules().items()
        if "../shared" in path.read_text() or "shared/papers" in path.read_text()
    ]
    assert outside == []


def test_no_runtime_module_imports_the_tools_or_the_test_bed():
    found = modules()
    known = set(found) | the_testbed_modules()
    assert f"{ROOT}.engine" in found and f"{ROOT}.layers.routed_experts" in found
    assert f"{TESTBED}.fixtures" in known
    offenders = {
        name: sorted(
            t
            for t in imports_of(name, path.read_text(), path.name == "__init__.py", known)
            if t.startswith((TOOLS, TESTBED))
        )
        for name, path in found.items()
        if not name.startswith(TOOLS) and name != f"{ROOT}.cli"
    }
    # The specexpert command dispatches to tools by name, lazily; it is not the runtime.
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_module_of_the_package_imports_the_test_bed():
    # The test bed is not in the wheel: an import of it from the package (the specexpert
    # command, a tool) fails where the plugin is installed.
    found = modules()
    known = set(found) | the_testbed_modules()
    offenders = {
        name: sorted(
            t
            for t in imports_of(name, path.read_text(), path.name == "__init__.py", known)
            if t.startswith(TESTBED)
        )
        for name, path in found.items()
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_scanner_sees_function_level_and_relative_imports(tmp_path):
    """The scanner would catch the imports the runtime must not have (checked on a
    module that lives outside the source tree)."""
    source = (
        "def f():\n    from ..tools import embedded_model\n"
        "    import vllm_specexpert.tools.corpus\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from vllm_specexpert import engine\n"
    )
    (tmp_path / "probe.py").write_text(source)
    known = set(modules())
    names = imports_of(f"{ROOT}.layers.probe", (tmp_path / "probe.py").read_text(), False, known)
    assert names == {f"{ROOT}.tools.embedded_model", f"{ROOT}.tools.corpus"}


def test_loading_the_plugin_loads_no_tool_nor_the_test_bed():
    code = (
        "import sys\n"
        "from vllm_specexpert.plugins import register\n"
        "register()\n"
        "import vllm_specexpert.layers.routed_experts, vllm_specexpert.layers.model_classes\n"
        "import vllm_specexpert.worker, vllm_specexpert.engine\n"
        f"print(sorted(m for m in sys.modules if m.startswith(('{TOOLS}', '{TESTBED}'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_every_counter_class_is_a_stats_counters():
    # One way to add, reset and write counters (stats.Counters): a class named for its
    # counts that keeps its own is a second way (LayerStats holds two PhaseStats).
    classes: dict[str, list[str]] = {}
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def is_counters(name: str) -> bool:
        return name == "Counters" or any(is_counters(b) for b in classes.get(name, []))

    named = [n for n in classes if re.search(r"(Stats|Counters)$", n) and n != "LayerStats"]
    assert len(named) > 10 and [n for n in named if not is_counters(n)] == []
