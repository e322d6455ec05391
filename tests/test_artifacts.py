"""Artifacts are checked whole when the engine starts (issue 13, D3): a damaged or
mismatched calibration or path predictor is one config error naming its field, never a
traceback at start or a crash at the first decode step. No vLLM engine is started: these
are the loaders the plugin calls where it builds the engine config."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from vllm_specexpert.calibration import WEIGHTS_FILE, load_calibration
from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.predict import path as path_module
from vllm_specexpert.tools.embedded_model import ASSETS, TRAINED_MODEL_DIR

CALIBRATION = ASSETS / "tiny-qwen3-moe-calibration"
PATH_PREDICTOR = ASSETS / "tiny-qwen3-moe-path-predictor"
MODEL = str(TRAINED_MODEL_DIR)
HF_CONFIG = AutoConfig.from_pretrained(MODEL)


def load(directory: Path):
    return load_calibration(directory, model=MODEL, hf_config=HF_CONFIG, num_experts=64)


def edit_tensors(directory: Path, change) -> None:
    tensors = load_file(str(directory / WEIGHTS_FILE))
    change(tensors)
    save_file(tensors, str(directory / WEIGHTS_FILE))


def edit_manifest(directory: Path, change) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    change(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))


def nan_vectors(t):
    t["layers.3.default_vectors"][5] = float("nan")


DAMAGE = {
    "truncated safetensors": (
        lambda d: (d / WEIGHTS_FILE).write_bytes((d / WEIGHTS_FILE).read_bytes()[:5000]),
        "unreadable",
    ),
    "garbage safetensors": (
        lambda d: (d / WEIGHTS_FILE).write_bytes(b"\x00garbage" * 100),
        "unreadable",
    ),
    "manifest not JSON": (lambda d: (d / "manifest.json").write_text("{'format': 2"), "not JSON"),
    "manifest without moe_layer_indices": (
        lambda d: edit_manifest(d, lambda m: m.pop("moe_layer_indices")),
        "moe_layer_indices",
    ),
    "manifest layer absent from the file": (
        lambda d: edit_manifest(d, lambda m: m["moe_layer_indices"].append(9)),
        "no tensor layers.9.default_vectors",
    ),
    "default vectors of the wrong shape": (
        lambda d: edit_tensors(
            d, lambda t: t.update({"layers.2.default_vectors": torch.zeros(64, 128)})
        ),
        r"shape \[64, 128\]",
    ),
    "co-activation of the wrong shape": (
        lambda d: edit_tensors(
            d, lambda t: t.update({"layers.0.coactivation": torch.zeros(32, 32, dtype=torch.int64)})
        ),
        r"layers.0.coactivation has shape \[32, 32\], expected \[64, 64\]",
    ),
    "NaN in the default vectors": (lambda d: edit_tensors(d, nan_vectors), "non-finite"),
    "manifest for another expert count": (
        lambda d: edit_manifest(d, lambda m: m.update(num_experts=32)),
        "num_experts 32",
    ),
}


def test_the_shipped_calibration_loads():
    calibration = load(CALIBRATION)
    assert sorted(calibration.default_vectors) == list(range(8))
    assert calibration.default_vectors[0].shape == (64, 256)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_calibration_is_one_error_naming_the_field(tmp_path, damage):
    directory = tmp_path / "calibration"
    shutil.copytree(CALIBRATION, directory)
    apply, message = DAMAGE[damage]
    apply(directory)
    with pytest.raises(SpecExpertConfigError, match=message) as info:
        load(directory)
    assert info.value.field_name == "calibration"
    assert "\n" not in str(info.value)


def test_the_shipped_path_predictor_loads():
    predictor = path_module.load_path_predictor(PATH_PREDICTOR, model=MODEL, hf_config=HF_CONFIG)
    assert predictor.shape.num_experts == 64


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncated", "path_predictor.safetensors"),
        ("nan", "non-finite"),
        ("manifest", "manifest.json"),
        # Issue 22 (4): the message stopped at "Error(s) in loading state_dict for
        # RoutingPathPredictor:." without the tensor or the shapes.
        ("shape", r"(\S+) has shape \[3, 5\], expected \[\d+(, \d+)*\]"),
        ("extra", "unexpected tensor extra.weight"),
        ("missing", "no tensor "),
    ],
)
def test_a_damaged_path_predictor_is_one_error_naming_the_field(tmp_path, damage, message):
    directory = tmp_path / "rpp"
    shutil.copytree(PATH_PREDICTOR, directory)
    weights = directory / path_module.WEIGHTS_FILE
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:4000])
    elif damage in ("nan", "shape", "extra", "missing"):
        tensors = load_file(str(weights))
        first = next(iter(tensors))
        if damage == "nan":
            tensors[first] = tensors[first].clone().fill_(float("nan"))
        elif damage == "shape":
            tensors[first] = torch.zeros(3, 5)
        elif damage == "extra":
            tensors["extra.weight"] = torch.zeros(2)
        else:
            del tensors[first]
        save_file(tensors, str(weights))
    else:
        (directory / "manifest.json").write_text("[]")
    with pytest.raises(SpecExpertConfigError, match=message) as info:
        path_module.load_path_predictor(directory, model=MODEL, hf_config=HF_CONFIG)
    assert info.value.field_name == "path_predictor"
    assert "\n" not in str(info.value)
    if damage == "shape":  # the tensor named is the one damaged
        first = next(iter(load_file(str(weights))))
        assert f"{first} has shape [3, 5]" in str(info.value)
