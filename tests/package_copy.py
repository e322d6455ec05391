"""A copy of the package to extend as an author would (a module, its registry line, its
word in the map), and what runs on it in a fresh interpreter: the tests that show what
adding a feature or a slow tier costs (``test_adding_a_feature``,
``test_adding_a_slow_tier``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import vllm_specexpert

TESTS = Path(__file__).parent
PACKAGE = Path(vllm_specexpert.__file__).parent


def copy_package(root: Path) -> Path:
    """The package copied under ``root``; returns the copy's package directory."""
    shutil.copytree(PACKAGE, root / "vllm_specexpert", ignore=shutil.ignore_patterns("__pycache__"))
    return root / "vllm_specexpert"


def add_module(package: Path, path: str, module: str, registry: tuple[str, str, str]) -> None:
    """Write ``module`` at ``path`` (under the package) and its line in the registry:
    ``registry`` is (the registry's file, the text to find, what it becomes; found once).
    The caller adds its word to the map (:func:`edit`)."""
    (package / path).write_text(module)
    edit(package / registry[0], registry[1], registry[2])


def edit(file: Path, old: str, new: str) -> None:
    text = file.read_text()
    assert text.count(old) == 1, f"{file}: {old!r} found {text.count(old)} times"
    file.write_text(text.replace(old, new))


def run_in_copy(root: Path, *args: str) -> subprocess.CompletedProcess:
    """``python *args`` in a fresh interpreter on the copy under ``root`` (the tests'
    helpers on its path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(TESTS)])}
    return subprocess.run(
        [sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )


def layout_check(root: Path) -> subprocess.CompletedProcess:
    """``tests/test_layout.py`` run on the copy under ``root``."""
    return run_in_copy(
        root, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "test_layout.py")
    )


def report_of(done: subprocess.CompletedProcess) -> dict:
    """What a script run in the copy printed as its ``REPORT {json}`` line."""
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT "))
