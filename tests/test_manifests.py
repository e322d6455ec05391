"""Every artifact manifest has one schema, checked on read (issue 37, items 3-5): a
corrupt ``manifest.json`` or ``analysis.json`` is one config error naming the field, the
file, the key and the command that remakes it, before anything is allocated, never a
bare ``AttributeError``/``KeyError``/``TypeError`` here or later in the vLLM worker.
No engine is started except in the last test, which stops at the engine config."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from vllm_specexpert.artifacts import FINGERPRINT_CONFIG_KEYS, ModelFingerprint
from vllm_specexpert.calibration import load_calibration
from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.predict.estimator_network import load_estimator
from vllm_specexpert.predict.hybrid import check_layers, hybrid_layers, read_analysis
from vllm_specexpert.predict.path import load_path_predictor
from vllm_specexpert.tools.embedded_model import ASSETS, TRAINED_MODEL_DIR

MODEL = str(TRAINED_MODEL_DIR)
HF_CONFIG = AutoConfig.from_pretrained(MODEL)
CALIBRATION = ASSETS / "tiny-qwen3-moe-calibration"

# field -> (shipped directory, manifest file, loader with every check, remake command)
ARTIFACTS = {
    "estimator": (
        ASSETS / "tiny-qwen3-moe-estimator",
        "manifest.json",
        lambda d: load_estimator(d, model=MODEL, hf_config=HF_CONFIG, calibration=CALIBRATION),
        "specexpert train-estimator",
    ),
    "calibration": (
        CALIBRATION,
        "manifest.json",
        lambda d: load_calibration(d, model=MODEL, hf_config=HF_CONFIG, num_experts=64),
        "specexpert calibrate",
    ),
    "analysis": (
        ASSETS / "tiny-qwen3-moe-analysis",
        "analysis.json",
        lambda d: read_analysis(d, model=MODEL, hf_config=HF_CONFIG),
        "specexpert analyze",
    ),
    "path_predictor": (
        ASSETS / "tiny-qwen3-moe-path-predictor",
        "manifest.json",
        lambda d: load_path_predictor(d, model=MODEL, hf_config=HF_CONFIG),
        "specexpert train-path",
    ),
}

LOADERS = {
    "estimator": load_estimator,
    "calibration": load_calibration,
    "analysis": read_analysis,
    "path_predictor": load_path_predictor,
}
"""The loaders themselves (no model, or one given by the test)."""


def damaged(tmp_path: Path, field: str, change) -> Path:
    """A copy of the shipped ``field`` artifact with its manifest changed in place."""
    source, name, _, _ = ARTIFACTS[field]
    directory = tmp_path / field
    shutil.copytree(source, directory)
    manifest = json.loads((directory / name).read_text())
    change(manifest)
    (directory / name).write_text(json.dumps(manifest))
    return directory


def refused(field: str, directory: Path, key: str) -> SpecExpertConfigError:
    """The artifact is refused with one error naming the field, its manifest file, the
    key and the command that remakes it."""
    _, name, load, command = ARTIFACTS[field]
    with pytest.raises(SpecExpertConfigError) as info:
        load(directory)
    message = str(info.value)
    assert info.value.field_name == field, message
    assert f"{directory / name}: key {key}:" in message, message
    assert command in info.value.fix, message
    assert "\n" not in message
    return info.value


def put(path: str, value):
    """A change setting ``a.b.0.c`` (dots, list indices) of a manifest to ``value``."""

    def change(manifest):
        *parents, last = path.split(".")
        node = manifest
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(last) if isinstance(node, list) else last] = value

    return change


def drop(path: str):
    def change(manifest):
        *parents, last = path.split(".")
        node = manifest
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        del node[last]

    return change


@pytest.mark.parametrize("field", list(ARTIFACTS))
def test_the_shipped_artifacts_load(field):
    source, _, load, _ = ARTIFACTS[field]
    assert load(source) is not None


@pytest.mark.parametrize("field", list(ARTIFACTS))
def test_unknown_keys_are_kept(tmp_path, field):
    # Older and newer writers add information keys: not a reason to refuse.
    directory = damaged(tmp_path, field, lambda m: m.update(written_by="a later version"))
    directory = damaged(
        tmp_path / "deep", field, lambda m: m["model_fingerprint"].update(rope_theta=1e6)
    )
    assert ARTIFACTS[field][2](directory) is not None


# (field, change, the key named). The first five are the tester's cases (issue 37 item 3):
# each raised a bare Python exception before.
CORRUPT = [
    ("estimator", put("model_fingerprint", ["Qwen3MoeForCausalLM"]), "model_fingerprint"),
    ("estimator", put("calibration", "tiny-qwen3-moe-calibration"), "calibration"),
    ("estimator", put("shape.latent", -5), "shape.latent"),
    ("estimator", put("shape.latent", 2**40), "shape.latent"),
    ("analysis", put("model_fingerprint", "Qwen3MoeForCausalLM"), "model_fingerprint"),
    ("estimator", put("shape.mlp_ratio", 10**9), "shape.mlp_ratio"),
    ("estimator", put("shape.hidden_size", "256"), "shape.hidden_size"),
    ("estimator", put("shape.num_experts", True), "shape.num_experts"),
    ("estimator", put("shape.top_k", 65), "shape.top_k"),
    ("estimator", put("shape.blocks", 2), "shape.blocks"),
    ("estimator", drop("shape.num_transitions"), "shape.num_transitions"),
    ("estimator", put("moe_layer_indices", [0, 1, 2]), "moe_layer_indices"),
    ("estimator", put("moe_layer_indices", [0, 1, 2, 3, 4, 5, 7, 6]), "moe_layer_indices"),
    ("estimator", put("calibration.sha256", 42), "calibration.sha256"),
    ("estimator", put("model_fingerprint.hidden_size", "256"), "model_fingerprint.hidden_size"),
    ("estimator", put("model_fingerprint.router_sha256", "0"), "model_fingerprint.router_sha256"),
    (
        "estimator",
        put("model_fingerprint.architectures", "Qwen3MoeForCausalLM"),
        "model_fingerprint.architectures",
    ),
    ("calibration", put("model_fingerprint", []), "model_fingerprint"),
    ("calibration", drop("model_fingerprint"), "model_fingerprint"),
    ("calibration", put("num_experts", -64), "num_experts"),
    ("calibration", put("hidden_size", 256.5), "hidden_size"),
    ("calibration", put("moe_layer_indices", "0-7"), "moe_layer_indices"),
    ("calibration", put("moe_layer_indices", [0, 1, -2]), "moe_layer_indices.2"),
    ("calibration", put("moe_layer_indices", []), "moe_layer_indices"),
    ("calibration", put("moe_layer_indices", [0, 0, 1]), "moe_layer_indices"),
    ("path_predictor", put("model_fingerprint", 7), "model_fingerprint"),
    ("path_predictor", put("shape.vocab_size", -1), "shape.vocab_size"),
    ("path_predictor", put("shape.hidden", 2**40), "shape.hidden"),
    ("path_predictor", put("shape.window", "8"), "shape.window"),
    ("path_predictor", drop("moe_layer_indices"), "moe_layer_indices"),
    ("path_predictor", put("moe_layer_indices", [0, 1]), "moe_layer_indices"),
    # Issue 37 item 4: these passed read_analysis and failed in the worker (KeyError,
    # TypeError) or were accepted by a substring test.
    ("analysis", drop("transitions"), "transitions"),
    (
        "analysis",
        put("transitions.2.quasi_hidden.recall", "0.63"),
        "transitions.2.quasi_hidden.recall",
    ),
    ("analysis", put("predictors", "quasi_hidden"), "predictors"),
    ("analysis", put("predictors", ["router"]), "predictors"),
    ("analysis", drop("transitions.0.quasi_hidden"), "transitions.0.quasi_hidden"),
    (
        "analysis",
        put("transitions.1.quasi_hidden.recall", 1.5),
        "transitions.1.quasi_hidden.recall",
    ),
    (
        "analysis",
        put("transitions.1.quasi_hidden.recall", float("nan")),
        "transitions.1.quasi_hidden.recall",
    ),
    ("analysis", put("transitions.3.from_layer", None), "transitions.3.from_layer"),
    ("analysis", put("transitions.3", "layer 3"), "transitions.3"),
    ("analysis", put("transitions", []), "transitions"),
    ("analysis", put("transitions.1.from_layer", 0), "transitions"),  # a duplicate
    ("analysis", put("top_k", 8), "top_k"),  # the fingerprint's is 4
    ("analysis", lambda m: m.clear(), "model_fingerprint"),
    ("calibration", put("hidden_size", 128), "hidden_size"),  # the fingerprint's is 256
]


@pytest.mark.parametrize(
    "field, change, key", CORRUPT, ids=[f"{f}-{k}-{i}" for i, (f, _, k) in enumerate(CORRUPT)]
)
def test_a_corrupt_manifest_is_one_error_naming_field_file_key_and_fix(
    tmp_path, field, change, key
):
    refused(field, damaged(tmp_path, field, change), key)


def test_sizes_are_checked_against_the_weights_file_before_anything_is_allocated(
    tmp_path, monkeypatch
):
    # Within the schema's bounds, but a network of 2.7e11 parameters (1.1 TB): the
    # header of the 0.4 MB weights file says otherwise, and that is read first; the
    # network is never built.
    from vllm_specexpert.predict import estimator_network

    directory = damaged(
        tmp_path, "estimator", lambda m: m["shape"].update(latent=1 << 16, mlp_ratio=64)
    )

    devices = []  # where each network was built: shapes only, on the meta device
    real_init = estimator_network.ExpertEstimator.__init__

    def built(self, *args, **kwargs):
        devices.append(torch.get_default_device().type)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(estimator_network.ExpertEstimator, "__init__", built)
    with pytest.raises(
        SpecExpertConfigError,
        match=r"has shape \[\d+(, \d+)*\], expected "
        r"\[\d+(, \d+)*\]",
    ) as info:
        ARTIFACTS["estimator"][2](directory)
    assert info.value.field_name == "estimator"
    assert devices == ["meta"]


def test_a_fingerprint_is_every_config_key_and_the_router_hash():
    assert set(ModelFingerprint.model_fields) == {*FINGERPRINT_CONFIG_KEYS, "router_sha256"}


def test_an_artifact_without_a_fingerprint_is_refused_when_checked_against_a_model(tmp_path):
    directory = damaged(tmp_path, "estimator", drop("model_fingerprint"))
    with pytest.raises(SpecExpertConfigError, match="does not say which model") as info:
        ARTIFACTS["estimator"][2](directory)
    assert info.value.field_name == "estimator"
    assert load_estimator(directory) is not None  # nothing to check it against


@pytest.mark.parametrize(
    "field, sizes",
    [
        ("estimator", {"hidden_size": 128}),
        ("path_predictor", {"vocab_size": 20000}),
        ("calibration", {"num_local_experts": 32}),
    ],
)
def test_a_fingerprint_unlike_the_artifacts_own_sizes_is_refused(tmp_path, field, sizes):
    # The artifact claims a model (by its fingerprint) whose sizes are not its own.
    directory = damaged(tmp_path, field, lambda m: m["model_fingerprint"].update(sizes))
    value = next(iter(sizes.values()))
    with pytest.raises(SpecExpertConfigError, match=f"the fingerprint's {value}") as info:
        LOADERS[field](directory)  # no model: the manifest alone
    assert info.value.field_name == field


@pytest.mark.parametrize("field", list(ARTIFACTS))
def test_a_hub_model_is_compared_by_its_config(field):
    # Not a local directory: only the config's shapes. transformers 5 answers the alias
    # num_experts with num_local_experts' 64, where config.json (and so the fingerprint)
    # has no num_experts: the same model, not "another model".
    source, load = ARTIFACTS[field][0], LOADERS[field]
    assert load(source, model="Qwen/not-a-local-directory", hf_config=HF_CONFIG) is not None
    other = AutoConfig.from_pretrained(MODEL, num_experts_per_tok=8)
    with pytest.raises(SpecExpertConfigError, match="another model"):
        load(source, model="Qwen/not-a-local-directory", hf_config=other)


def test_what_read_analysis_lets_through_the_worker_can_use(tmp_path):
    # The worker's readers (hybrid_layers, check_layers) work on any analysis the schema
    # accepts; with extra predictors and keys included.
    directory = damaged(
        tmp_path,
        "analysis",
        lambda m: m["transitions"][0].update(other_predictor={"recall": 0.1}, note="x"),
    )
    analysis = read_analysis(directory)
    chosen, threshold = hybrid_layers(analysis, None)
    assert 0 < threshold < 1 and set(chosen) <= set(range(7))
    check_layers(analysis, list(range(8)))


def test_an_analysis_without_an_estimator_is_refused_at_engine_start(tmp_path):
    # Issue 37 item 5: it was ignored silently (even a path that does not exist), though
    # it could never be used: hybrid needs an estimator, which cannot be added later.
    from vllm_harness import make_llm

    from specexpert_testbed.fixtures import TRAINED_MODEL

    for analysis in (str(tmp_path / "missing"), str(ARTIFACTS["analysis"][0])):
        with pytest.raises(SpecExpertConfigError, match="no estimator is set") as info:
            make_llm(TRAINED_MODEL, specexpert={"analysis": analysis})
        assert info.value.field_name == "analysis"
