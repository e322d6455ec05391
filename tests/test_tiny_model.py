"""The committed trained model (``specexpert train-tiny``): the artifact is what its model
card says. Loading in vLLM with and without the plugin is covered by
``test_exactness.py`` (model ``trained``)."""

import json
import math

import pytest
import torch

from vllm_specexpert.tools import corpus
from vllm_specexpert.tools.fixtures import TRAINED_MODEL_DIR
from vllm_specexpert.tools.train_tiny import evaluate_loss, routing_metrics, tokenize_split

METRICS = json.loads((TRAINED_MODEL_DIR / "metrics.json").read_text())


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(str(TRAINED_MODEL_DIR), dtype=torch.float32).eval()


def card_files():
    """The validation files the card lists, if this interpreter has the same ones."""
    by_path = {f.relpath: f for f in corpus.corpus_files("validation")}
    files = []
    for entry in METRICS["validation_files"]:
        f = by_path.get(entry["relpath"])
        if f is None or f.size != entry["size"]:
            pytest.skip(f"this interpreter's stdlib differs from the training corpus "
                        f"({entry['relpath']} missing or resized): the card's losses do not apply")
        files.append((f, entry))
    return files


def test_checkpoint_is_small_bf16_qwen3_moe():
    from safetensors import safe_open

    config = json.loads((TRAINED_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["vocab_size"] >= 10240
    weights = TRAINED_MODEL_DIR / "model.safetensors"
    assert weights.stat().st_size <= 30 * 2**20
    with safe_open(str(weights), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_validation_loss_matches_the_model_card(model):
    for f, entry in card_files():
        result = evaluate_loss(model, tokenize_split("validation", [f]))
        assert result.tokens == entry["tokens"]
        assert result.loss == pytest.approx(entry["loss"], abs=0.01), f.relpath


def test_model_learned_something(model):
    """Far below the unigram entropy of the same tokens: the model uses context."""
    files = [f for f, _ in card_files()]
    tokens = tokenize_split("validation", files)
    loss = evaluate_loss(model, tokens).loss
    counts = torch.bincount(tokens).double()
    p = counts[counts > 0] / counts.sum()
    unigram = float(-(p * p.log()).sum())
    assert loss < unigram - 2.0, (loss, unigram)


def test_routing_is_learned_and_uses_the_experts(model):
    files = [f for f, _ in card_files()]
    tokens = tokenize_split("validation", files)
    layers = routing_metrics(model, tokens, top_k=model.config.num_experts_per_tok)
    assert len(layers) == model.config.num_hidden_layers
    for layer in layers:
        # Peaked per-token routing (uniform would be log E) ...
        assert layer["router_entropy"] < 0.75 * math.log(model.config.num_experts), layer
        # ... spread over most experts across tokens.
        assert layer["experts_used_1pct"] >= 0.75, layer
