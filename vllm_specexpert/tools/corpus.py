"""The Python corpus of the embedded model: the source code this project's own environment
installs (site-packages of the running interpreter: torch, vllm, transformers, numpy, ...)
plus the CPython standard library.

    specexpert corpus [--out DIR]     # rebuild: scan, filter, split, tokenize, fingerprint

Rules, in order (``scan``):

* ``.py`` files of the stdlib and of site-packages; not in ``test``/``tests``/``testing``
  directories, CPython's ``idlelib``/``lib2to3``/``encodings``, vendored copies
  (``_vendor``, ``vendored``, ``third_party``, ``externals``, ``_distutils``, ...), or
  ``__pycache__``; not empty and not over 1 MB;
* not generated: no "generated"/"do not edit" marker in a comment of the first 12 lines,
  no ``_pb2.py`` (transformers' modeling files made from its ``modular_*.py`` go here);
* deduplicated by content (sha256): of identical files the first by path is kept.

Splits are fixed by hashes, so they do not depend on scan order or on the set of other
files: a **package** (first path component under site-packages, or ``stdlib``) whose
name hashes below ``TEST_PACKAGE_PERCENT`` is the package-level **test** split, never
trained on (generalization across projects); of the other files, those whose relative path
hashes below ``VALIDATION_PERCENT`` are **validation**, the rest **train**. The fingerprint
(sha256 over sorted path, size and content hash) goes into the model card.

Tokenized splits are cached per fingerprint and tokenizer under
``$SPECEXPERT_CACHE/corpus`` (uint16, one EOS after each file), so training streams them
instead of re-reading 200+ MB of text.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SKIP_DIRS = frozenset(
    {
        "__pycache__",
        "test",
        "tests",
        "testing",
        "idlelib",
        "lib2to3",
        "encodings",
        "_vendor",
        "vendor",
        "vendored",
        "_vendored",
        "third_party",
        "externals",
        "_distutils",
        "site-packages",
    }
)
"""Directory names whose files are skipped: test suites (huge and repetitive), two CPython
tools, codec tables, vendored copies of other packages, and (inside the stdlib root) the
third-party tree, which is scanned on its own."""
MAX_BYTES = 1_000_000
GENERATED = re.compile(r"generated|do not edit|do not modify", re.IGNORECASE)
TEST_PACKAGE_PERCENT = 10
"""Share of packages (by name hash) held out whole as the package-level test split."""
VALIDATION_PERCENT = 2
"""Share of the remaining files (by path hash) held out for validation."""
SPLITS = ("train", "validation", "test")


def bucket(text: str, salt: str = "") -> int:
    """A fixed number in [0, 100) for ``text`` (sha256): the splits' hash."""
    return int.from_bytes(hashlib.sha256((salt + text).encode()).digest()[:4], "big") % 100


@dataclass(frozen=True)
class CorpusFile:
    path: Path
    relpath: str
    """``stdlib/...`` or ``site-packages/...``, forward slashes."""
    package: str
    """``stdlib``, or the first path component under site-packages."""
    size: int
    sha256: str

    @property
    def split(self) -> str:
        if self.package != "stdlib" and bucket(self.package) < TEST_PACKAGE_PERCENT:
            return "test"
        return "validation" if bucket(self.relpath) < VALIDATION_PERCENT else "train"

    def read(self) -> str:
        return self.path.read_text(encoding="utf-8", errors="replace")


def roots() -> dict[str, Path]:
    """The two trees the corpus is made of, for the running interpreter."""
    paths = sysconfig.get_paths()
    return {"stdlib": Path(paths["stdlib"]), "site-packages": Path(paths["purelib"])}


def _generated(data: bytes, name: str) -> bool:
    if name.endswith("_pb2.py"):
        return True
    for line in data[:4000].decode("utf-8", "replace").splitlines()[:12]:
        if line.lstrip().startswith("#") and GENERATED.search(line):
            return True
    return False


@lru_cache(maxsize=1)
def scan() -> tuple[CorpusFile, ...]:
    """Every corpus file of this environment, filtered and deduplicated (module doc),
    sorted by relative path."""
    found: dict[str, CorpusFile] = {}
    for source, root in roots().items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if any(part in SKIP_DIRS for part in rel.parts[:-1]):
                continue
            if source == "site-packages" and rel.parts[0].endswith((".dist-info", ".egg-info")):
                continue
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if not data or len(data) > MAX_BYTES or _generated(data, path.name):
                continue
            digest = hashlib.sha256(data).hexdigest()
            if digest in found:
                continue
            package = (
                "stdlib"
                if source == "stdlib"
                else (rel.parts[0] if len(rel.parts) > 1 else rel.stem)
            )
            found[digest] = CorpusFile(
                path, f"{source}/{rel.as_posix()}", package, len(data), digest
            )
    return tuple(sorted(found.values(), key=lambda f: f.relpath))


def corpus_files(split: str | None = None) -> list[CorpusFile]:
    """The corpus's files sorted by relative path; ``split`` is one of ``SPLITS`` or
    ``None`` (all)."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}")
    return [f for f in scan() if split is None or f.split == split]


def fingerprint(files: list[CorpusFile] | None = None) -> str:
    """sha256 over the sorted (relative path, size, content hash) list."""
    files = corpus_files() if files is None else files
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relpath}\0{f.size}\0{f.sha256}\n".encode())
    return h.hexdigest()


def describe() -> dict:
    """What the corpus is, for model cards: sources, fingerprint, files and bytes per
    split, the test packages, the largest training packages."""
    files = corpus_files()
    by_split = {s: [f for f in files if f.split == s] for s in SPLITS}
    packages: dict[str, int] = {}
    for f in by_split["train"]:
        packages[f.package] = packages.get(f.package, 0) + f.size
    return {
        # The roots by what they are, not where: a path names only the making machine.
        "source": f"CPython {sys.version.split()[0]} standard library and the site-packages "
        "of the environment that ran it",
        "roots": {"stdlib": "sysconfig path 'stdlib'", "site-packages": "sysconfig path 'purelib'"},
        "fingerprint": fingerprint(files),
        "files": {s: len(v) for s, v in by_split.items()},
        "bytes": {s: sum(f.size for f in v) for s, v in by_split.items()},
        "test_packages": sorted({f.package for f in by_split["test"]}),
        "train_packages": len(packages),
        "largest_train_packages": dict(sorted(packages.items(), key=lambda kv: -kv[1])[:12]),
    }


def iter_texts(split: str) -> Iterator[str]:
    for f in corpus_files(split):
        yield f.read()


# ------------------------------------------------------------------ token cache


def cache_dir() -> Path:
    import os

    base = os.environ.get("SPECEXPERT_CACHE", Path.home() / ".cache" / "vllm-specexpert")
    return Path(base) / "corpus"


def tokens(split: str, tokenizer_json: Path):
    """The ``split`` encoded with ``tokenizer_json``, each file followed by EOS, as a
    uint16 numpy array (memory-mapped from the cache; built on first use)."""
    import numpy as np

    key = hashlib.sha256(
        (fingerprint() + hashlib.sha256(Path(tokenizer_json).read_bytes()).hexdigest()).encode()
    ).hexdigest()[:16]
    path = cache_dir() / key / f"{split}.u16"
    if not path.exists():
        _encode_split(split, tokenizer_json, path)
    return np.memmap(path, dtype=np.uint16, mode="r")


def _encode_split(split: str, tokenizer_json: Path, path: Path) -> None:
    import numpy as np
    from tokenizers import Tokenizer

    from vllm_specexpert.tools.progress import progress_bar

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    assert tokenizer.get_vocab_size() <= 65536
    eos = tokenizer.token_to_id("<|endoftext|>")
    files = corpus_files(split)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        for start in progress_bar(
            f"tokenize {split}", iterable=range(0, len(files), 256), unit="x256 files"
        ):
            chunk = files[start : start + 256]
            for encoding in tokenizer.encode_batch([f.read() for f in chunk]):
                np.asarray([*encoding.ids, eos], dtype=np.uint16).tofile(out)
    tmp.replace(path)


# ---------------------------------------------------------------------- command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", type=Path, help="also write the manifest (every file with its split) as JSON here"
    )


def _is_manifest(path: Path) -> bool:
    """Whether ``path`` is a corpus manifest (``--out``) written before."""
    try:
        return "files_list" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False


def run(args: argparse.Namespace) -> None:
    from vllm_specexpert.tools.arguments import check_output_file

    if args.out:
        check_output_file(args.out, "--out", _is_manifest, "a corpus manifest")
    info = describe()
    print(json.dumps(info, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    **info,
                    "files_list": [
                        {
                            "relpath": f.relpath,
                            "package": f.package,
                            "size": f.size,
                            "sha256": f.sha256,
                            "split": f.split,
                        }
                        for f in corpus_files()
                    ],
                },
                indent=0,
            )
        )
        print(f"wrote {args.out}")
