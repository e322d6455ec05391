"""The tools' arguments, checked before any work: argparse types for numbers in range and
for the paths a tool reads (a model directory, a data file, an artifact directory), and
the checks that need the parsed arguments (an output directory the tool may write, input
and output apart, an artifact that matches the model).

A bad argument is one line, ``specexpert TOOL: error: argument X: ...`` after the usage,
and exit status 2: argparse's own format. A type raises
:class:`argparse.ArgumentTypeError` (argparse names the argument); a check after parsing
raises :class:`UsageError`, which ``specexpert`` (:func:`vllm_specexpert.cli.main`)
reports through the tool's parser the same way.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from collections.abc import Callable
from pathlib import Path


class UsageError(ValueError):
    """A bad argument found after parsing; the message starts with ``argument NAME:``."""

    def __init__(self, option: str, problem: str):
        super().__init__(f"argument {option}: {problem}")


# -------------------------------------------------------------------- numbers


def _number(text: str, kind: type, test: Callable[[float], bool], what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")) or not test(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (counts, sizes, steps)."""
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _number(text, float, lambda v: v > 0, "a positive number")


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    return _number(text, float, lambda v: v >= 0, "a number >= 0")


# ---------------------------------------------------------------- input paths


def _existing(text: str, is_kind, kind: str) -> str:
    """``text`` when it names something that exists and ``is_kind`` (a ``Path``
    predicate) holds, else an argparse error saying which."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    if not is_kind(path):
        raise argparse.ArgumentTypeError(f"{text} is not {kind}")
    return text


def existing_file(text: str) -> str:
    """A file that exists and is a regular file (text to run, ...)."""
    return _existing(text, Path.is_file, "a regular file")


def data_files(text: str) -> list[str]:
    """The text files one ``--data`` word names: a regular file, or the regular files a
    glob matches (``'src/**/*.py'``, quoted so that no shell expands it; ``**``: any
    depth), sorted. Empty ones are left out by :func:`files_with_text`, once all are
    parsed."""
    if Path(text).exists() or not glob.has_magic(text):
        return [existing_file(text)]
    matches = sorted(p for p in glob.glob(text, recursive=True) if Path(p).is_file())
    if not matches:
        raise argparse.ArgumentTypeError(f"{text} matches no file")
    return matches


def files_with_text(paths: list[str], option: str = "--data") -> list[str]:
    """``paths`` without the empty files (a glob over a source tree brings every empty
    ``__init__.py``), which are named in one note on stderr; a :class:`UsageError` when
    no file holds text."""
    empty = {p for p in paths if Path(p).stat().st_size == 0}
    kept = [p for p in paths if p not in empty]
    skipped = [p for p in paths if p in empty]
    if not kept:
        if len(paths) == 1:
            raise UsageError(option, f"{paths[0]} is empty")
        raise UsageError(option, f"all {len(paths)} files are empty ({_first(skipped)})")
    if skipped:
        files = "file" if len(skipped) == 1 else "files"
        print(
            f"note: {option}: skipped {len(skipped)} empty {files}: {_first(skipped)}",
            file=sys.stderr,
        )
    return kept


def _first(names: list[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names``, then how many more."""
    more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def existing_dir(text: str) -> str:
    """A directory that exists (an artifact: its contents are checked by its loader)."""
    return _existing(text, Path.is_dir, "a directory")


def _checkpoint_config(text: str, safetensors: bool = False) -> dict:
    """A local checkpoint directory's ``config.json`` (a JSON object), every
    ``*.safetensors`` file's header readable and its data complete (a file cut short is
    found here, from its header, without reading the tensors); ``safetensors``: at least
    one such file."""
    from safetensors import safe_open

    path = Path(existing_dir(text))
    config_path = path / "config.json"
    if not config_path.is_file():
        raise argparse.ArgumentTypeError(
            f"{text} holds no config.json: not a Hugging Face model directory"
        )
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{config_path}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"{config_path}: not a JSON object")
    files = sorted(path.glob("*.safetensors"))
    if safetensors and not files:
        raise argparse.ArgumentTypeError(f"{text} holds no *.safetensors file")
    for weights in files:
        try:
            with safe_open(str(weights), "pt"):
                pass
        except Exception as exc:  # noqa: BLE001 - safetensors' own error types
            raise argparse.ArgumentTypeError(
                f"{weights}: unreadable ({str(exc).splitlines()[0]}; cut short?)"
            ) from None
    return config


def model_dir(text: str) -> str:
    """A local model directory: present, with a ``config.json`` and readable
    ``*.safetensors`` files."""
    _checkpoint_config(text)
    return text


def unquantized_model_dir(text: str) -> str:
    """A model directory the transformers-based tools can run (calibrate, analyze, capture,
    train-estimator, train-path, eval-path): not a quantized checkpoint."""
    config = _checkpoint_config(text)
    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise argparse.ArgumentTypeError(
            f"{text} is a quantized checkpoint ({method}); this tool runs the model with "
            f"transformers, which cannot load it. Fix: run it on its bf16 twin (`specexpert "
            f"dequantize {text} TWIN`): the routers are the same, so what it makes for TWIN "
            "(calibration, estimator, path predictor, analysis) has the quantized model's "
            "fingerprint and is accepted for it"
        )
    return text


def quantized_model_dir(text: str) -> str:
    """A checkpoint with a ``quantization_config`` of a format this package reads."""
    from vllm_specexpert.config import SpecExpertUnsupportedError
    from vllm_specexpert.quant_config import format_of

    config = _checkpoint_config(text, safetensors=True)
    try:
        fmt = format_of(config.get("quantization_config"))
    except SpecExpertUnsupportedError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if fmt is None:
        raise argparse.ArgumentTypeError(
            f"{text} is not quantized (no quantization_config in its config.json)"
        )
    return text


def bf16_model_dir(text: str) -> str:
    """A checkpoint to quantize: not quantized already."""
    config = _checkpoint_config(text, safetensors=True)
    if config.get("quantization_config"):
        raise argparse.ArgumentTypeError(
            f"{text} is quantized already (quantization_config "
            "in its config.json); give its bf16 checkpoint"
        )
    return text


# ------------------------------------------------------------------ outputs


def manifest_format(path: Path) -> str | None:
    """The ``format`` of ``path/manifest.json`` (``None``: none, or not readable)."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    found = manifest.get("format") if isinstance(manifest, dict) else None
    return found if isinstance(found, str) else None


def artifact_of(fmt: str) -> Callable[[Path], bool]:
    """Whether a directory holds an artifact of ``fmt``'s kind (``specexpert-calibration/2``:
    any version of ``specexpert-calibration``): a directory a tool may write again."""
    kind = fmt.split("/")[0] + "/"
    return lambda path: (manifest_format(path) or "").startswith(kind)


def holding(*names: str) -> Callable[[Path], bool]:
    """Whether a directory holds one of these files (a tool's own output)."""
    return lambda path: any((path / name).is_file() for name in names)


def check_output_dir(
    path: str | Path, option: str, reusable: Callable[[Path], bool], what: str
) -> Path:
    """``path`` as an output directory: absent (made by the tool, under a directory or
    nothing), empty, or one that ``reusable`` recognises as ``what`` written before (so
    rewriting it loses nothing else). A regular file, or a directory holding other
    things, is a :class:`UsageError` naming ``option``."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise UsageError(option, f"{path} exists and is not a directory")
        if any(path.iterdir()) and not reusable(path):
            raise UsageError(
                option,
                f"{path} is a directory that holds other things than "
                f"{what}; give a new or empty directory (or one this tool wrote)",
            )
        return path
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(option, f"cannot make {path}: {parent} is not a directory")
    return path


def existing_ancestor(path: str | Path) -> Path:
    """``path`` if it exists, else its nearest existing parent (whose filesystem an
    output made there would land on)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def check_output_file(
    path: str | Path, option: str, reusable: Callable[[Path], bool], what: str
) -> Path:
    """``path`` as an output file: absent (under a directory or nothing), or ``what``
    written before."""
    path = Path(path)
    if path.exists():
        if not path.is_file():
            raise UsageError(option, f"{path} exists and is not a regular file")
        if not reusable(path):
            raise UsageError(option, f"{path} exists and is not {what}; give a new file name")
        return path
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(option, f"cannot make {path}: {parent} is not a directory")
    return path


def check_apart(source: str | Path, out: str | Path, option: str) -> None:
    """The output directory neither is the input nor lies inside it, nor the input inside
    it (writing would overwrite or mix with what is being read)."""
    a, b = Path(source).resolve(), Path(out).resolve()
    if a == b:
        raise UsageError(option, f"{out} is the input directory itself; give another")
    if a in b.parents:
        raise UsageError(
            option, f"{out} lies inside the input directory {source}; give one outside it"
        )
    if b in a.parents:
        raise UsageError(
            option, f"{out} contains the input directory {source}; give one outside it"
        )


def check_shape(schema: type, arguments: dict[str, tuple[str, int]], **others) -> None:
    """Arguments that size a network (``{"--latent": ("latent", 128)}``) checked against
    the ranges of its artifact's shape schema (the one place they are stated) before any
    work; ``others``: the shape's other fields, any valid value (they come from the
    model, later)."""
    from pydantic import ValidationError

    try:
        schema(**others, **dict(arguments.values()))
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        field = first["loc"][0] if first["loc"] else None
        for option, (name, value) in arguments.items():
            if name == field:
                message = first["msg"][0].lower() + first["msg"][1:]
                raise UsageError(option, f"{message}, got {value}") from None
        raise


def check_artifact(option: str, load: Callable[[], object]):
    """``load()`` (an artifact loader, which checks the artifact against the model): its
    :class:`~vllm_specexpert.config.SpecExpertConfigError` as a :class:`UsageError`
    naming ``option``. Returns what it loaded."""
    from vllm_specexpert.config import SpecExpertConfigError

    try:
        return load()
    except SpecExpertConfigError as exc:
        raise UsageError(option, f"{exc.problem}. Fix: {exc.fix}") from None
