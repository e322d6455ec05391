"""The text every machine of this kind has: the running interpreter's CPython standard
library, read in a deterministic order and split by file into train and validation.

Used to train the tokenizer and the embedded model, and by calibration and analysis as
held-out text. The split is by a hash of each file's path relative to the stdlib root,
so it does not depend on the order or number of files; :func:`fingerprint` (relative
paths + sizes) tells two interpreters' corpora apart.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SKIP_PARTS = ("site-packages", "test", "tests", "idlelib", "lib2to3", "encodings", "__pycache__")
"""Path components excluded from the corpus: third-party code, CPython's own test suite
(huge and repetitive), two tools, and the codec tables of `encodings` (mostly data)."""

VALIDATION_PERCENT = 5
"""Share of files (by path hash) held out for validation."""


@dataclass(frozen=True)
class CorpusFile:
    path: Path
    relpath: str
    """Path relative to the stdlib root, with forward slashes."""
    size: int

    @property
    def split(self) -> str:
        digest = hashlib.sha256(self.relpath.encode()).digest()
        return "validation" if int.from_bytes(digest[:4], "big") % 100 < VALIDATION_PERCENT else "train"

    def read(self) -> str:
        return self.path.read_text(encoding="utf-8", errors="replace")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(split: str | None = None) -> list[CorpusFile]:
    """The corpus's ``.py`` files sorted by relative path; ``split`` is ``"train"``,
    ``"validation"`` or ``None`` (all)."""
    if split not in (None, "train", "validation"):
        raise ValueError(f"split must be 'train', 'validation' or None, got {split!r}")
    root = stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in SKIP_PARTS for part in rel.parts):
            continue
        files.append(CorpusFile(path, rel.as_posix(), path.stat().st_size))
    files.sort(key=lambda f: f.relpath)
    return [f for f in files if split is None or f.split == split]


def fingerprint(files: list[CorpusFile] | None = None) -> str:
    """sha256 over the sorted (relative path, size) list: equal on equal corpora."""
    files = corpus_files() if files is None else files
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relpath}\0{f.size}\n".encode())
    return h.hexdigest()


def describe() -> dict:
    """Fingerprint and counts of the corpus of this interpreter (for model cards)."""
    import sys

    files = corpus_files()
    by_split = {s: [f for f in files if f.split == s] for s in ("train", "validation")}
    return {
        "source": f"CPython {sys.version.split()[0]} standard library ({stdlib_root()})",
        "fingerprint": fingerprint(files),
        "files": {s: len(v) for s, v in by_split.items()},
        "bytes": {s: sum(f.size for f in v) for s, v in by_split.items()},
    }


def iter_texts(split: str) -> Iterator[str]:
    for f in corpus_files(split):
        yield f.read()
