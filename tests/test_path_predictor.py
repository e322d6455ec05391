"""The routing-path predictor (ExpertFlow §3.2): windows, training, artifacts, evaluation."""

import json
import shutil
from itertools import pairwise

import numpy as np
import pytest
import torch

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.predict.path import (
    WEIGHTS_FILE,
    PathPredictorShape,
    RoutingPathPredictor,
    load_path_predictor,
    save_path_predictor,
    sliding_windows,
)
from vllm_specexpert.tools.embedded_model import ASSETS, TRAINED_MODEL_DIR
from vllm_specexpert.tools.train_path import routing_matrix, train

SHIPPED = ASSETS / "tiny-qwen3-moe-path-predictor"


def test_windows_end_at_each_token_and_pad_before_the_start():
    ids = torch.tensor([5, 6, 7])
    assert sliding_windows(ids, 3, pad=9).tolist() == [[9, 9, 5], [9, 5, 6], [5, 6, 7]]
    model = RoutingPathPredictor(
        PathPredictorShape(vocab_size=9, num_layers=1, num_experts=4, top_k=1, window=3)
    )
    assert model.windows_of([[5, 6, 7], [5], []]).tolist() == [[5, 6, 7], [9, 9, 5], [9, 9, 9]]


def test_training_learns_a_routing_that_depends_on_the_last_two_tokens():
    # Layer 0 routes by the current token, layer 1 by the previous one: the predictor
    # must use its window, and an untrained one must not already know it.
    vocab, num_experts = 40, 8
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab, (6000,), generator=g)
    windows = sliding_windows(tokens, 2, pad=vocab)
    previous = torch.cat([torch.tensor([0]), tokens[:-1]])
    paths = torch.stack(
        [
            torch.stack([tokens % 8, (tokens + 3) % 8], -1),
            torch.stack([previous % 8, (previous + 5) % 8], -1),
        ],
        dim=1,
    )
    shape = PathPredictorShape(
        vocab_size=vocab,
        num_layers=2,
        num_experts=num_experts,
        top_k=2,
        window=2,
        embed_dim=16,
        hidden=64,
    )

    def recall(model):
        predicted = routing_matrix(model.predict_topk(windows[1:]), num_experts)
        return float((predicted * routing_matrix(paths[1:], num_experts)).sum() / paths[1:].numel())

    assert recall(RoutingPathPredictor(shape).eval()) < 0.5
    model, info = train(windows, paths, shape, steps=400, batch=256, lr=1e-2)
    assert recall(model) > 0.95
    assert info["held_out_bce"] < 0.1


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("rpp")
    with open(TRAINED_MODEL_DIR / "config.json") as f:
        config = json.load(f)
    from vllm_specexpert.artifacts import model_fingerprint

    shape = PathPredictorShape(
        vocab_size=config["vocab_size"],
        num_layers=2,
        num_experts=64,
        top_k=4,
        embed_dim=8,
        hidden=16,
    )
    model = RoutingPathPredictor(shape).eval()
    save_path_predictor(
        out,
        model,
        {
            "model": str(TRAINED_MODEL_DIR),
            "model_fingerprint": model_fingerprint(TRAINED_MODEL_DIR),
        },
    )
    return out, model


def test_artifact_round_trips_and_is_checked_against_the_model(artifact, tmp_path):
    out, model = artifact
    loaded = load_path_predictor(out, model=str(TRAINED_MODEL_DIR))
    windows = torch.randint(100, (5, 8))
    assert torch.equal(loaded.predict_topk(windows), model.predict_topk(windows))
    # Made for another model: the fingerprint differs.
    other = tmp_path / "other"
    shutil.copytree(out, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["model_fingerprint"]["router_sha256"] = "0" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SpecExpertConfigError, match=r"path_predictor.*another model"):
        load_path_predictor(other, model=str(TRAINED_MODEL_DIR))


@pytest.mark.parametrize("damage", ["missing", "truncated", "nan", "manifest"])
def test_a_damaged_artifact_is_one_error_naming_the_field(artifact, tmp_path, damage):
    out, _ = artifact
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    weights = broken / WEIGHTS_FILE
    if damage == "missing":
        weights.unlink()
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "nan":
        from safetensors.torch import load_file, save_file

        state = load_file(str(weights))
        state["mlp.0.weight"][0, 0] = float("nan")
        save_file(state, str(weights))
    else:
        (broken / "manifest.json").write_text("{not json")
    with pytest.raises(SpecExpertConfigError, match="field 'path_predictor'") as error:
        load_path_predictor(broken)
    assert "\n" not in str(error.value)  # one line, no traceback text


def test_config_key():
    config = SpecExpertConfig.from_dict({"path_predictor": "/tmp/rpp"})
    assert config.path_predictor == "/tmp/rpp"
    with pytest.raises(SpecExpertConfigError, match="path_predictor"):
        SpecExpertConfig.from_dict({"path_predictor": 3})


def test_shipped_predictor_beats_the_papers_baselines_on_held_out_text():
    """The gate of the shipped predictor: on held-out text it beats ExpertFlow's TLP
    and SLP baselines at batch 8 and 32. Baselines are checked against a direct count."""
    from vllm_specexpert.tools.eval_path import evaluate
    from vllm_specexpert.tools.trace import file_documents

    docs = file_documents([str(TRAINED_MODEL_DIR / "heldout" / "test.txt")])
    result = evaluate(
        TRAINED_MODEL_DIR,
        docs,
        SHIPPED,
        window=128,
        max_tokens=3000,
        batches=(1, 8, 32),
        samples=100,
    )
    b_acc = {
        m: {b: result["results"][m][str(b)]["b_acc"] for b in (1, 8, 32)} for m in result["methods"]
    }
    for b in (8, 32):
        assert b_acc["rpp"][b] > max(b_acc["tlp"][b], b_acc["slp"][b]), b_acc
    # Chance at batch 1 is top_k / E per layer; every method must be well above it,
    # and the previous token's experts cannot all be right.
    assert 4 / 64 < b_acc["tlp"][1] < 0.9 and 4 / 64 < b_acc["slp"][1] < 0.9
    # TLP at batch 1, counted directly from the model's routes: the share of a token's
    # experts that the previous token of its window also used (nothing for a window's
    # first token), over layers 1..L-1.
    from vllm_specexpert.tools.trace import load_model, trace

    model, tokenizer = load_model(TRAINED_MODEL_DIR)
    shared, entries = 0, 0
    for t in trace(
        model,
        tokenizer,
        file_documents([str(TRAINED_MODEL_DIR / "heldout" / "test.txt")]),
        128,
        3000,
    ):
        ids = t.topk_ids[:, 1:].numpy()  # [T, L-1, K]
        entries += ids.size
        shared += sum(
            len(set(a) & set(b))
            for before, now in pairwise(ids)
            for a, b in zip(now, before, strict=True)
        )
    assert np.isclose(b_acc["tlp"][1], shared / entries)
