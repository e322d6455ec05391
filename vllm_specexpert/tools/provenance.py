"""How the tools' outputs name what they were made from, so that the name says something on
another machine: the embedded model and the shipped artifacts by their path in the
package (``vllm_specexpert/assets/tiny-qwen3-moe``), a Hugging Face cache snapshot by its
repo id, another model by its directory's name, another file or directory by its path
relative to the output directory, a data file by its package path or as given; never the
making machine's absolute path. Names are for people and messages: artifacts are matched
to a model by fingerprint and hashes, never by path.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
"""The ``vllm_specexpert`` package directory."""


def _package_path(resolved: Path) -> str | None:
    if resolved == PACKAGE_ROOT or PACKAGE_ROOT in resolved.parents:
        return f"{PACKAGE_ROOT.name}/{resolved.relative_to(PACKAGE_ROOT).as_posix()}"
    return None


def model_label(model_dir: str | Path) -> str:
    """A model directory's name: its package path (the embedded model), its repo id (a
    Hugging Face cache snapshot, ``.../models--ORG--NAME/snapshots/COMMIT``), or else
    the directory's own name."""
    resolved = Path(model_dir).resolve()
    parts = resolved.parts
    for i, part in enumerate(parts):
        if part.startswith("models--") and parts[i + 1 : i + 2] == ("snapshots",):
            return part.removeprefix("models--").replace("--", "/")
    return _package_path(resolved) or resolved.name


def path_label(path: str | Path, relative_to: str | Path) -> str:
    """A path recorded in a file of the directory ``relative_to``: its package path (a
    shipped artifact or file), or else relative to that directory."""
    resolved = Path(path).resolve()
    return (
        _package_path(resolved)
        or Path(os.path.relpath(resolved, Path(relative_to).resolve())).as_posix()
    )


def file_label(path: str | Path) -> str:
    """A data file's name in a description: its package path (a shipped file, such as
    the embedded model's held-out text), or else the path as given."""
    return _package_path(Path(path).resolve()) or str(path)


def command_line() -> str:
    """The command that ran, as ``specexpert ...`` (recorded beside results)."""
    import shlex

    return shlex.join(["specexpert", *sys.argv[1:]])
