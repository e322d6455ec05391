"""The committed trained model (``specexpert train-tiny``): the artifact is what its model
card says. Every number is recomputed here independently of the training tool: the text
of the card's held-out files ships with the model (``heldout/``), tokens come from the
checkpoint's own tokenizer through transformers, and losses from transformers' own
causal-LM loss (``labels=``). Loading in vLLM with and without the plugin is covered by
``test_exactness.py`` (model ``trained``)."""

import hashlib
import json
import math

import pytest
import torch

from vllm_specexpert.tools.fixtures import TRAINED_MODEL_DIR

METRICS = json.loads((TRAINED_MODEL_DIR / "metrics.json").read_text())
WINDOW = METRICS["train_config"]["seq_len"]
"""The card's losses are over windows of this many predicted tokens."""


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(str(TRAINED_MODEL_DIR), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def card_tokens():
    """Per card file: (card entry, its tokens + EOS), from the shipped text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TRAINED_MODEL_DIR))
    files = []
    for entry in METRICS["validation_files"]:
        text = (TRAINED_MODEL_DIR / entry["sample"]).read_text(encoding="utf-8")
        assert hashlib.sha256(text.encode()).hexdigest() == entry["sha256"], entry["sample"]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        files.append((entry, torch.tensor(ids)))
    return files


def hf_loss(model, tokens: torch.Tensor) -> float:
    """Mean next-token NLL in windows of WINDOW predictions, by transformers' loss: each
    window's input is its WINDOW + 1 tokens, labelled with themselves (shifted inside)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(tokens) - 1, WINDOW):
            chunk = tokens[start : start + WINDOW + 1][None]
            predicted = chunk.shape[1] - 1
            total += float(model(input_ids=chunk, labels=chunk).loss) * predicted
            count += predicted
    return total / count


def test_checkpoint_is_small_bf16_qwen3_moe():
    from safetensors import safe_open

    config = json.loads((TRAINED_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["vocab_size"] >= 10240
    weights = TRAINED_MODEL_DIR / "model.safetensors"
    assert weights.stat().st_size <= 30 * 2**20
    with safe_open(str(weights), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_held_out_losses_match_the_model_card(model, card_tokens):
    for entry, tokens in card_tokens:
        assert len(tokens) - 1 == entry["tokens"], entry["sample"]
        assert hf_loss(model, tokens) == pytest.approx(entry["loss"], abs=0.01), entry["sample"]


def test_model_learned_something(model, card_tokens):
    """Far below the unigram entropy of the same tokens: the model uses context."""
    tokens = torch.cat([t for _, t in card_tokens])
    counts = torch.bincount(tokens).double()
    p = counts[counts > 0] / counts.sum()
    unigram = float(-(p * p.log()).sum())
    loss = hf_loss(model, tokens)
    assert loss < unigram - 2.0, (loss, unigram)


def test_routing_is_learned_and_uses_the_experts(model, card_tokens):
    tokens = torch.cat([t for _, t in card_tokens])
    windows = tokens[: len(tokens) // WINDOW * WINDOW].reshape(-1, WINDOW)
    with torch.no_grad():
        logits = model(input_ids=windows, output_router_logits=True).router_logits
    config = model.config
    assert len(logits) == config.num_hidden_layers
    for layer, layer_logits in enumerate(logits):
        probs = torch.softmax(layer_logits.float(), dim=-1)
        # Peaked per-token routing (uniform would be log E) ...
        entropy = float(-(probs * probs.clamp_min(1e-12).log()).sum(-1).mean())
        assert entropy < 0.75 * math.log(config.num_experts), (layer, entropy)
        # ... spread over most experts across tokens: >= 1 % of the routed tokens each.
        chosen = probs.topk(config.num_experts_per_tok, -1).indices.reshape(-1)
        share = torch.bincount(chosen, minlength=config.num_experts).double() / len(probs)
        assert float((share >= 0.01).double().mean()) >= 0.75, (layer, share)
