"""``specexpert TOOL ...``: arguments checked before any work (one ``error:`` line, exit
status 2, no traceback, nothing written), the tools' own configuration errors as one line,
progress on stderr, and outputs that name their inputs portably (issue 37, item 6)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from specexpert_testbed.fixtures import model_path
from vllm_specexpert import cli
from vllm_specexpert.tools.embedded_model import (
    ASSETS,
    TRAINED_CALIBRATION_DIR,
    TRAINED_ESTIMATOR_DIR,
    TRAINED_MODEL_DIR,
)

TRANSFORMERS_TOOLS = (
    "calibrate",
    "analyze",
    "capture",
    "train_estimator",
    "train_path",
    "eval_path",
)


class Loaded(Exception):
    """Raised where a tool would start its work: reaching it means the checks passed."""


@pytest.fixture(scope="module")
def fixture_models():
    """The fixture models the tests use, built (by the tools patched below) first."""
    return [
        model_path(name)
        for name in ("qwen3_moe", "qwen3_moe-awq", "qwen3_moe-awq-twin", "qwen3_moe-fp8")
    ]


@pytest.fixture(autouse=True)
def no_work(monkeypatch, fixture_models):
    """Loading a model or reading a checkpoint's tensors is the work: it raises
    :class:`Loaded` (tests that run a tool for real take ``real_work``)."""
    import importlib

    def loaded(*args, **kwargs):
        raise Loaded("the tool started its work")

    for name in TRANSFORMERS_TOOLS:
        monkeypatch.setattr(
            importlib.import_module(f"vllm_specexpert.tools.{name}"), "load_model", loaded
        )
    for name in ("quantize", "dequantize"):
        monkeypatch.setattr(
            importlib.import_module(f"vllm_specexpert.tools.{name}"), "read_checkpoint", loaded
        )
    for name, work in (("train_tiny", "train"), ("corpus", "describe")):
        monkeypatch.setattr(importlib.import_module(f"vllm_specexpert.tools.{name}"), work, loaded)


@pytest.fixture
def real_work(monkeypatch):
    monkeypatch.undo()


def refused(capsys, argv: list[str], option: str) -> str:
    """Run ``specexpert ARGV``: exit status 2 and exactly one ``error:`` line, naming
    ``option``, without a traceback; returns that line."""
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    assert f"argument {option}:" in lines[0], lines[0]
    assert "Traceback" not in err
    return lines[0]


def started(argv: list[str]) -> None:
    """The checks of ``specexpert ARGV`` pass: the tool gets to its work."""
    with pytest.raises(Loaded):
        cli.main(argv)


# --------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--steps", "0"),
        ("--eval-every", "0"),
        ("--latent", "0"),
        ("--mlp-ratio", "0"),
        ("--eval-tokens", "0"),
        ("--max-tokens", "-5"),
        ("--window", "0"),
        ("--steps", "2.5"),
    ],
)
def test_train_estimator_refuses_a_count_below_one(capsys, tmp_path, flag, value):
    out = tmp_path / "est"
    line = refused(capsys, ["train-estimator", "--out", str(out), flag, value], flag)
    assert "positive integer" in line and repr(value) in line
    assert not out.exists()


def test_train_estimator_refuses_a_size_above_the_manifest_schema(capsys, tmp_path):
    # The estimator's shape schema caps latent: its manifest would be refused on read.
    line = refused(
        capsys, ["train-estimator", "--out", str(tmp_path / "e"), "--latent", "100000"], "--latent"
    )
    assert "100000" in line


@pytest.mark.parametrize(
    "argv, option",
    [
        (["calibrate", "--max-tokens", "0"], "--max-tokens"),
        (["calibrate", "--window", "0"], "--window"),
        (["capture", "--shard-tokens", "0"], "--shard-tokens"),
        (["train-path", "--steps", "0"], "--steps"),
        (["train-path", "--context", "0"], "--context"),
        (["train-path", "--context", "5000"], "--context"),
    ],
)
def test_data_tools_refuse_counts_out_of_range(capsys, tmp_path, argv, option):
    refused(capsys, [*argv, "--out", str(tmp_path / "out")], option)
    assert not (tmp_path / "out").exists()


def test_eval_path_refuses_a_batch_of_zero_and_one_above_the_tokens(capsys, tmp_path):
    predictor = str(ASSETS / "tiny-qwen3-moe-path-predictor")
    refused(
        capsys,
        [
            "eval-path",
            "--path-predictor",
            predictor,
            "--out",
            str(tmp_path / "a"),
            "--batches",
            "1",
            "0",
        ],
        "--batches",
    )
    refused(
        capsys,
        [
            "eval-path",
            "--path-predictor",
            predictor,
            "--out",
            str(tmp_path / "a"),
            "--batches",
            "64",
            "--max-tokens",
            "32",
        ],
        "--batches",
    )
    assert not (tmp_path / "a").exists()


# ------------------------------------------------------------------ --out


OUT_TOOLS = [
    ["train-estimator"],
    ["calibrate"],
    ["analyze"],
    ["capture"],
    ["train-path"],
    ["eval-path", "--path-predictor", str(ASSETS / "tiny-qwen3-moe-path-predictor")],
]


@pytest.mark.parametrize("tool", OUT_TOOLS, ids=lambda t: t[0])
def test_out_naming_an_existing_file_is_refused_before_any_work(capsys, tmp_path, tool):
    out = tmp_path / "taken"
    out.write_text("mine")
    line = refused(capsys, [*tool, "--out", str(out)], "--out")
    assert "not a directory" in line
    assert out.read_text() == "mine"


@pytest.mark.parametrize("tool", OUT_TOOLS, ids=lambda t: t[0])
def test_out_holding_other_things_is_refused(capsys, tmp_path, tool):
    (tmp_path / "notes.txt").write_text("mine")
    refused(capsys, [*tool, "--out", str(tmp_path)], "--out")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize(
    "tool, artifact",
    [
        (["calibrate"], TRAINED_CALIBRATION_DIR),
        (["train-estimator"], TRAINED_ESTIMATOR_DIR),
        (["analyze"], ASSETS / "tiny-qwen3-moe-analysis"),
        (["train-path"], ASSETS / "tiny-qwen3-moe-path-predictor"),
        (
            ["eval-path", "--path-predictor", str(ASSETS / "tiny-qwen3-moe-path-predictor")],
            ASSETS / "tiny-qwen3-moe-path-predictor",
        ),
    ],
    ids=lambda t: t[0] if isinstance(t, list) else "",
)
def test_out_that_the_tool_wrote_before_is_reused(tmp_path, tool, artifact):
    out = tmp_path / "again"
    shutil.copytree(artifact, out)
    started([*tool, "--out", str(out)])
    started([*tool, "--out", str(tmp_path / "new" / "dir")])  # made when absent
    (tmp_path / "empty").mkdir()
    started([*tool, "--out", str(tmp_path / "empty")])


def test_train_tiny_and_corpus_refuse_an_output_that_is_not_theirs(capsys, tmp_path):
    (tmp_path / "file").write_text("mine")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.txt").write_text("mine")
    refused(capsys, ["train-tiny", "--out", str(tmp_path / "file")], "--out")
    refused(capsys, ["train-tiny", "--out", str(tmp_path / "dir")], "--out")
    refused(capsys, ["train-tiny", "--steps", "0"], "--steps")
    refused(capsys, ["corpus", "--out", str(tmp_path / "dir")], "--out")
    refused(capsys, ["corpus", "--out", str(tmp_path / "file")], "--out")
    assert (tmp_path / "file").read_text() == "mine"
    started(["train-tiny", "--out", str(tmp_path / "new")])


def test_capture_rewritten_keeps_no_old_shard(tmp_path, real_work):
    text = tmp_path / "text.py"
    text.write_text("def f(x):\n    return x + 1\n" * 40)
    out = tmp_path / "capture"
    for shard_tokens, shards in (("16", 2), ("64", 1)):  # a shard holds whole windows
        cli.main(
            [
                "capture",
                "--data",
                str(text),
                "--max-tokens",
                "64",
                "--window",
                "32",
                "--shard-tokens",
                shard_tokens,
                "--out",
                str(out),
            ]
        )
        assert len(list(out.glob("shard-*.safetensors"))) == shards
    assert (
        json.loads((out / "manifest.json").read_text())["model"]
        == "vllm_specexpert/assets/tiny-qwen3-moe"
    )


def test_out_under_a_file_is_refused(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    line = refused(capsys, ["calibrate", "--out", str(tmp_path / "file" / "cal")], "--out")
    assert "not a directory" in line


def test_another_tools_artifact_is_not_reused(capsys, tmp_path):
    out = tmp_path / "cal"
    shutil.copytree(TRAINED_CALIBRATION_DIR, out)
    refused(capsys, ["train-path", "--out", str(out)], "--out")


# ------------------------------------------------------------- inputs


@pytest.mark.parametrize(
    "tool", ["calibrate", "analyze", "capture", "train-estimator", "train-path"]
)
def test_a_model_that_is_missing_a_file_or_without_config_is_refused(capsys, tmp_path, tool):
    (tmp_path / "file").write_text("")
    (tmp_path / "empty").mkdir()
    out = ["--out", str(tmp_path / "out")]
    assert "does not exist" in refused(capsys, [tool, str(tmp_path / "nope"), *out], "model")
    assert "not a directory" in refused(capsys, [tool, str(tmp_path / "file"), *out], "model")
    assert "config.json" in refused(capsys, [tool, str(tmp_path / "empty"), *out], "model")
    assert not (tmp_path / "out").exists()


def test_data_files_must_exist_be_regular_and_not_all_empty(capsys, tmp_path):
    out = ["--out", str(tmp_path / "out")]
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "text.txt").write_text("x = 1\n")
    for data, words in (
        (tmp_path / "nope.txt", "does not exist"),
        (tmp_path, "not a regular file"),
    ):
        line = refused(
            capsys, ["calibrate", "--data", str(tmp_path / "text.txt"), str(data), *out], "--data"
        )
        assert words in line
    line = refused(capsys, ["calibrate", "--data", str(tmp_path / "empty.txt"), *out], "--data")
    assert f"{tmp_path / 'empty.txt'} is empty" in line
    assert not (tmp_path / "out").exists()
    started(["calibrate", "--data", str(tmp_path / "text.txt"), *out])


@pytest.mark.parametrize("tool", ["calibrate", "capture", "train-estimator", "train-path"])
def test_empty_data_files_are_skipped_with_one_note(capsys, tmp_path, tool):
    """Issue 46 (11): ``--data django/**/*.py`` stopped at the first empty
    ``__init__.py``. Empty files are left out and named in one note; only when no file
    holds text is ``--data`` refused."""
    out = ["--out", str(tmp_path / "out")]
    empty = []
    for name in ("a", "b", "c", "d"):
        (tmp_path / name).mkdir()
        empty.append(tmp_path / name / "__init__.py")
        empty[-1].write_text("")
    text = tmp_path / "a" / "text.py"
    text.write_text("x = 1\n")
    data = [str(p) for p in (empty[0], text, *empty[1:])]
    started([tool, "--data", *data, *out])
    notes = [line for line in capsys.readouterr().err.splitlines() if "empty" in line]
    assert notes == [
        f"note: --data: skipped 4 empty files: {empty[0]}, {empty[1]}, {empty[2]}, ... (1 more)"
    ]
    line = refused(capsys, [tool, "--data", *map(str, empty), *out], "--data")
    assert "all 4 files are empty" in line
    assert not (tmp_path / "out").exists()


def test_the_documents_are_the_files_with_text(tmp_path, capsys):
    import argparse

    from vllm_specexpert.tools.trace import add_data_arguments, resolve_data_arguments

    (tmp_path / "empty.py").write_text("")
    (tmp_path / "text.py").write_text("x = 1\n")
    parser = argparse.ArgumentParser()
    add_data_arguments(parser)
    args = parser.parse_args(["--data", str(tmp_path / "empty.py"), str(tmp_path / "text.py")])
    _, documents, description = resolve_data_arguments(args, default_split="train")
    assert [name for name, _ in documents] == [str(tmp_path / "text.py")]
    assert "empty.py" not in description and "text.py" in description
    assert capsys.readouterr().err.count("skipped 1 empty file:") == 1


def test_a_quoted_glob_is_expanded_to_the_files_it_matches(tmp_path, capsys):
    """``--data 'pkg/**/*.py'`` (quoted: no shell expanded it) runs every .py file at any
    depth under pkg, sorted; a glob that matches no file is refused naming it."""
    import argparse

    from vllm_specexpert.tools.trace import add_data_arguments, resolve_data_arguments

    for name in ("pkg/a.py", "pkg/sub/b.py", "pkg/sub/deeper/c.py", "pkg/notes.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"# {name}\n")
    (tmp_path / "pkg" / "dir.py").mkdir()  # (a directory the glob matches: not a file)
    parser = argparse.ArgumentParser()
    add_data_arguments(parser)
    args = parser.parse_args(["--data", str(tmp_path / "pkg" / "**" / "*.py")])
    _, documents, _ = resolve_data_arguments(args, default_split="train")
    assert [name for name, _ in documents] == [
        str(tmp_path / p) for p in ("pkg/a.py", "pkg/sub/b.py", "pkg/sub/deeper/c.py")
    ]
    out = ["--out", str(tmp_path / "out")]
    line = refused(capsys, ["calibrate", "--data", str(tmp_path / "none" / "*.py"), *out], "--data")
    assert "matches no file" in line


def test_a_quantized_checkpoint_is_refused_with_its_bf16_twin_as_the_fix(capsys, tmp_path):
    awq = str(model_path("qwen3_moe-awq"))
    for tool in ("calibrate", "analyze", "capture", "train-estimator", "train-path"):
        line = refused(capsys, [tool, awq, "--out", str(tmp_path / "out")], "model")
        assert "quantized checkpoint (awq)" in line
        assert f"specexpert dequantize {awq} TWIN" in line and "accepted" in line
    started(["calibrate", str(model_path("qwen3_moe-awq-twin")), "--out", str(tmp_path / "o")])


def test_the_calibration_of_the_bf16_twin_is_accepted_for_the_quantized_model(tmp_path, real_work):
    """What the refusal above tells the user to do works."""
    from vllm_specexpert.calibration import load_calibration

    out = tmp_path / "twin-calibration"
    cli.main(
        [
            "calibrate",
            str(model_path("qwen3_moe-awq-twin")),
            "--split",
            "validation",
            "--max-tokens",
            "64",
            "--window",
            "32",
            "--out",
            str(out),
        ]
    )
    for quantized in ("qwen3_moe-awq", "qwen3_moe-fp8"):
        load_calibration(out, model=str(model_path(quantized)))


def test_an_estimator_without_calibration_is_refused(capsys, tmp_path):
    refused(
        capsys,
        ["analyze", "--estimator", str(TRAINED_ESTIMATOR_DIR), "--out", str(tmp_path / "a")],
        "--estimator",
    )


def test_a_bad_calibration_is_one_line_before_the_model_runs(capsys, tmp_path):
    bad = tmp_path / "cal"
    shutil.copytree(TRAINED_CALIBRATION_DIR, bad)
    (bad / "manifest.json").write_text("{not json")
    for tool in ("analyze", "train-estimator"):
        line = refused(
            capsys, [tool, "--calibration", str(bad), "--out", str(tmp_path / "o")], "--calibration"
        )
        assert "not JSON" in line and "Fix:" in line
    other = str(model_path("qwen3_moe"))
    line = refused(
        capsys,
        [
            "analyze",
            other,
            "--calibration",
            str(TRAINED_CALIBRATION_DIR),
            "--out",
            str(tmp_path / "o"),
        ],
        "--calibration",
    )
    assert "another model" in line


def test_a_bad_calibration_is_no_traceback_in_a_real_process(tmp_path):
    bad = tmp_path / "cal"
    bad.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_specexpert.cli",
            "analyze",
            "--calibration",
            str(bad),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "argument --calibration:" in errors[0], proc.stderr
    assert not (tmp_path / "o").exists()


def test_a_config_error_raised_by_a_tool_is_one_line(capsys):
    # The demo's settings are the plugin's: its own validation says what is wrong.
    with pytest.raises(SystemExit) as exited:
        cli.main(["demo", "--budget", "-1", "--no-compare"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.count("error:") == 1 and "field 'budget'" in err and "Traceback" not in err


# ------------------------------------------------- quantize / dequantize


def test_quantize_refuses_bad_sizes(capsys, tmp_path):
    model, out = str(model_path("qwen3_moe")), str(tmp_path / "q")
    refused(
        capsys, ["quantize", model, out, "--format", "awq", "--group-size", "0"], "--group-size"
    )
    refused(
        capsys, ["quantize", model, out, "--format", "awq", "--group-size", "48"], "--group-size"
    )
    refused(
        capsys,
        [
            "quantize",
            model,
            out,
            "--format",
            "fp8",
            "--fp8-scales",
            "block",
            "--fp8-block",
            "0",
            "0",
        ],
        "--fp8-block",
    )
    refused(
        capsys,
        ["quantize", model, out, "--format", "awq", "--fp8-block", "32", "32"],
        "--fp8-block",
    )
    refused(
        capsys, ["quantize", model, out, "--format", "fp8", "--group-size", "32"], "--group-size"
    )
    # 128 does not divide the down projection's 64 input features: found in the headers.
    line = refused(capsys, ["quantize", model, out, "--format", "awq"], "--group-size")
    assert "64 input features" in line
    assert not (tmp_path / "q").exists()


def test_quantize_refuses_an_output_that_is_or_holds_the_input(capsys, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(model_path("qwen3_moe"), model)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    for out, words in (
        (model, "input directory itself"),
        (model / "q", "inside the input"),
        (tmp_path, "contains the input"),
    ):
        line = refused(
            capsys,
            ["quantize", str(model), str(out), "--format", "awq", "--group-size", "32"],
            "out",
        )
        assert words in line
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


def test_quantize_refuses_a_quantized_checkpoint_and_a_foreign_output(capsys, tmp_path):
    refused(
        capsys,
        [
            "quantize",
            str(model_path("qwen3_moe-awq")),
            str(tmp_path / "q"),
            "--format",
            "gptq",
            "--group-size",
            "32",
        ],
        "model",
    )
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text("{}")
    refused(
        capsys,
        [
            "quantize",
            str(model_path("qwen3_moe")),
            str(tmp_path / "other"),
            "--format",
            "awq",
            "--group-size",
            "32",
        ],
        "out",
    )
    (tmp_path / "file").write_text("x")
    line = refused(
        capsys,
        [
            "quantize",
            str(model_path("qwen3_moe")),
            str(tmp_path / "file"),
            "--format",
            "awq",
            "--group-size",
            "32",
        ],
        "out",
    )
    assert "not a directory" in line


def test_quantize_and_dequantize_rewrite_their_own_output(tmp_path, real_work, capsys):
    model, q, twin = model_path("qwen3_moe"), tmp_path / "q", tmp_path / "twin"
    for _ in range(2):
        cli.main(["quantize", str(model), str(q), "--format", "awq", "--group-size", "32"])
        cli.main(["dequantize", str(q), str(twin)])
    stamp = json.loads((q / "specexpert-checkpoint.json").read_text())
    assert stamp == {"made_by": "specexpert quantize", "format": "awq", "from": "qwen3_moe"}
    assert not (twin / "fixture.json").exists()
    # Not the other command's output.
    line = refused(
        capsys, ["quantize", str(model), str(twin), "--format", "awq", "--group-size", "32"], "out"
    )
    assert "specexpert quantize" in line


def test_dequantize_refuses_a_truncated_checkpoint(capsys, tmp_path):
    model = tmp_path / "awq"
    shutil.copytree(model_path("qwen3_moe-awq"), model)
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    line = refused(capsys, ["dequantize", str(model), str(tmp_path / "twin")], "model")
    assert "model.safetensors" in line and "cut short" in line
    refused(capsys, ["dequantize", str(model_path("qwen3_moe")), str(tmp_path / "twin")], "model")
    assert not (tmp_path / "twin").exists()


# ------------------------------------------------------------- progress


def test_progress_counts_the_total_and_writes_lines_off_a_terminal(capsys, real_work):
    """Off a terminal (a log, a pipe) each redraw is a line of its own, with the total
    (counted first when there is no --max-tokens): tqdm's carriage returns alone show
    nothing to whatever reads lines until the run ends."""
    from vllm_specexpert.tools.trace import load_model, trace

    model, tokenizer = load_model(TRAINED_MODEL_DIR)
    documents = [("a.py", "def f(x):\n    return x + 1\n" * 8)]
    total = len(tokenizer(documents[0][1], add_special_tokens=False)["input_ids"])
    capsys.readouterr()
    assert (
        sum(
            len(t.token_ids)
            for t in trace(model, tokenizer, documents, window=16, progress="calibrate")
        )
        == total
    )
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("calibrate: ")]
    assert lines and lines[-1].startswith("calibrate: 100%") and f"{total}/{total}" in lines[-1]


# ----------------------------------------------------------- provenance


def absolute_strings(value) -> list[str]:
    """The strings in a JSON value that hold an absolute path."""
    if isinstance(value, dict):
        return [s for v in value.values() for s in absolute_strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in absolute_strings(v)]
    if isinstance(value, str) and (value.startswith("/") or " /" in value):
        return [value]
    return []


def test_shipped_artifacts_record_no_absolute_path():
    files = sorted(ASSETS.glob("tiny-qwen3-moe-*/*.json"))
    assert len(files) >= 6
    for path in files:
        assert absolute_strings(json.loads(path.read_text())) == [], path


def test_the_shipped_estimator_loads_with_its_calibration():
    from vllm_specexpert.predict.estimator_network import load_estimator

    load_estimator(
        TRAINED_ESTIMATOR_DIR, model=str(TRAINED_MODEL_DIR), calibration=TRAINED_CALIBRATION_DIR
    )


def test_written_artifacts_name_their_inputs_portably(tmp_path, real_work, capsys):
    text = tmp_path / "text.py"
    text.write_text("def f(x):\n    return x + 1\n" * 40)
    estimator = tmp_path / "est"
    cli.main(
        [
            "train-estimator",
            "--data",
            str(text),
            "--max-tokens",
            "64",
            "--window",
            "32",
            "--eval-tokens",
            "32",
            "--steps",
            "2",
            "--eval-every",
            "1",
            "--latent",
            "8",
            "--out",
            str(estimator),
        ]
    )
    manifest = json.loads((estimator / "manifest.json").read_text())
    assert manifest["model"] == "vllm_specexpert/assets/tiny-qwen3-moe"
    assert manifest["calibration"]["path"] == "vllm_specexpert/assets/tiny-qwen3-moe-calibration"
    for path in estimator.glob("*.json"):
        assert str(tmp_path) not in path.read_text().replace(str(text), ""), path
