"""The committed trained model (``specexpert train-tiny``): the artifact is what its model
card says, and it passes the quality gates. Every number is recomputed here independently
of the training tool: the held-out text ships with the model (``heldout/``), tokens come
from the checkpoint's own tokenizer through transformers, losses from transformers' own
causal-LM loss (``labels=``), routing statistics from the router logits. Loading in vLLM
with and without the plugin is covered by ``test_exactness.py`` (model ``trained``)."""

import hashlib
import json
import math

import pytest
import torch

from vllm_specexpert.tools.embedded_model import TRAINED_MODEL_DIR

METRICS = json.loads((TRAINED_MODEL_DIR / "metrics.json").read_text())
CONFIG = json.loads((TRAINED_MODEL_DIR / "config.json").read_text())
WINDOW = 256
"""The card's held-out losses are over windows of this many predicted tokens."""


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(str(TRAINED_MODEL_DIR), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def heldout():
    """Per split: (card entry, [N, WINDOW + 1] windows of the shipped text)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TRAINED_MODEL_DIR))
    samples = {}
    for split, entry in METRICS["heldout"].items():
        text = (TRAINED_MODEL_DIR / entry["sample"]).read_text(encoding="utf-8")
        assert hashlib.sha256(text.encode()).hexdigest() == entry["sha256"], entry["sample"]
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
        n = (len(ids) - 1) // WINDOW
        samples[split] = (
            entry,
            torch.stack([ids[i * WINDOW : i * WINDOW + WINDOW + 1] for i in range(n)]),
        )
    return samples


def hf_loss(model, windows: torch.Tensor) -> float:
    """Mean next-token NLL by transformers' loss: each window labelled with itself."""
    with torch.no_grad():
        return sum(float(model(input_ids=w[None], labels=w[None]).loss) for w in windows) / len(
            windows
        )


def unigram_entropy(tokens: torch.Tensor) -> float:
    counts = torch.bincount(tokens.reshape(-1)).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def test_checkpoint_is_a_small_bf16_qwen3_moe_with_many_experts():
    from safetensors import safe_open

    assert CONFIG["architectures"] == ["Qwen3MoeForCausalLM"]
    assert CONFIG["vocab_size"] >= 10240  # vllm bench draws prompt ids below 10,000
    assert CONFIG["num_local_experts"] >= 64 and CONFIG["num_experts_per_tok"] >= 4
    assert CONFIG["num_hidden_layers"] >= 8
    assert CONFIG["mlp_only_layers"] == [] and CONFIG["decoder_sparse_step"] == 1  # all MoE
    weights = TRAINED_MODEL_DIR / "model.safetensors"
    assert weights.stat().st_size <= 60e6
    with safe_open(str(weights), "pt") as f:
        # safe_open has keys() but is not iterable
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118


@pytest.mark.slow  # (the card changes only when `make model` retrains the model)
def test_held_out_losses_match_the_model_card(model, heldout):
    for split, (entry, windows) in heldout.items():
        assert windows[:, 1:].numel() == entry["tokens"], split
        assert hf_loss(model, windows) == pytest.approx(entry["loss"], abs=0.01), split


@pytest.mark.slow  # (the embedded model's own quality: it changes only with `make model`)
def test_gate_packages_never_trained_on_are_predicted_well(model, heldout):
    """Loss on the held-out packages well below 0.6 x the unigram entropy of the same
    tokens: the model uses context, across projects."""
    _, windows = heldout["test"]
    loss, unigram = hf_loss(model, windows), unigram_entropy(windows[:, 1:])
    print(
        f"test-package sample: loss {loss:.3f}, unigram entropy {unigram:.3f}, "
        f"ratio {loss / unigram:.3f}"
    )
    assert loss < 0.6 * unigram


@pytest.mark.slow  # (the embedded model's own quality: it changes only with `make model`)
def test_gates_routing_is_peaked_and_uses_every_expert(model, heldout):
    _, windows = heldout["validation"]
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1], output_router_logits=True).router_logits
    num_experts, top_k = CONFIG["num_local_experts"], CONFIG["num_experts_per_tok"]
    assert len(logits) == CONFIG["num_hidden_layers"]
    for layer, layer_logits in enumerate(logits):
        probs = torch.softmax(layer_logits.float(), dim=-1)
        # Far from uniform: mean per-token router entropy < 0.9 log E ...
        entropy = float(-(probs * probs.clamp_min(1e-12).log()).sum(-1).mean())
        assert entropy < 0.9 * math.log(num_experts), (layer, entropy)
        # ... and every expert gets >= 10 % of its fair share of the top-k assignments.
        chosen = probs.topk(top_k, -1).indices.reshape(-1)
        counts = torch.bincount(chosen, minlength=num_experts).double()
        fair_share = counts * num_experts / len(chosen)
        assert float(fair_share.min()) >= 0.1, (layer, fair_share.min())
