"""``specexpert capture``: per-token routing traces, streamed to disk in shards."""

import json

import pytest
import torch

from vllm_specexpert.artifacts import model_fingerprint
from vllm_specexpert.tools.capture import CaptureReader, capture
from vllm_specexpert.tools.embedded_model import TRAINED_MODEL_DIR

TEXTS = [
    (
        "a.py",
        "import os\n\n\ndef walk(path):\n    for root, dirs, files in os.walk(path):\n"
        "        for name in files:\n            yield os.path.join(root, name)\n" * 3,
    ),
    (
        "b.py",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    ),
]


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    out = tmp_path_factory.mktemp("capture")
    manifest = capture(TRAINED_MODEL_DIR, TEXTS, out, window=32, shard_tokens=40, dtype="float32")
    return out, manifest


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(TRAINED_MODEL_DIR), dtype=torch.float32).eval()


def test_manifest_and_shards_agree(captured):
    out, manifest = captured
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TRAINED_MODEL_DIR))
    lengths = [len(tok(text, add_special_tokens=False)["input_ids"]) for _, text in TEXTS]
    assert [d["tokens"] for d in manifest["documents"]] == lengths
    assert manifest["tokens"] == sum(lengths)
    assert len(manifest["shards"]) > 1  # streamed, not held in memory
    reader = CaptureReader(out)
    assert json.loads((out / "manifest.json").read_text()) == manifest
    rows = 0
    L, E, K, H = (manifest[k] for k in ("num_layers", "num_experts", "top_k", "hidden_size"))
    for shard, meta in zip(reader.shards(), manifest["shards"], strict=True):
        T = meta["tokens"]
        rows += T
        assert shard["router_logits"].shape == (T, L, E)
        assert shard["topk_ids"].shape == shard["topk_weights"].shape == (T, L, K)
        assert shard["residual"].shape == shard["router_input"].shape == (T, L, H)
        assert shard["positions"].max() < manifest["window"]
    assert rows == manifest["tokens"]


def test_captured_tensors_are_consistent_with_the_model(captured, model):
    out, manifest = captured
    shard = next(CaptureReader(out).shards())
    for i, layer_index in enumerate(manifest["moe_layer_indices"]):
        layer = model.model.layers[layer_index]
        r, s = shard["residual"][:, i], shard["router_input"][:, i]
        # s_l is post_attention_layernorm(r_l), the router sees s_l ...
        torch.testing.assert_close(layer.post_attention_layernorm(r), s, rtol=1e-5, atol=1e-5)
        logits = s @ layer.mlp.gate.weight.T
        torch.testing.assert_close(logits, shard["router_logits"][:, i], rtol=1e-4, atol=1e-4)
        # ... and picks the top-k of its softmax, weights renormalised (norm_topk_prob).
        probs = torch.softmax(shard["router_logits"][:, i], -1)
        top = probs.topk(manifest["top_k"], -1)
        assert torch.equal(top.indices.sort(-1).values, shard["topk_ids"][:, i].sort(-1).values)
        torch.testing.assert_close(
            shard["topk_weights"][:, i].sum(-1), torch.ones(len(s)), rtol=1e-5, atol=1e-5
        )
    # Windows restart positions: the first token of the second window has position 0.
    assert shard["positions"][manifest["window"]] == 0


def test_fingerprint_tells_models_apart(tmp_path):
    from specexpert_testbed.fixtures import ensure_model

    a = model_fingerprint(TRAINED_MODEL_DIR)
    b = model_fingerprint(ensure_model("qwen3_moe"))
    assert a == model_fingerprint(TRAINED_MODEL_DIR)
    assert a["router_sha256"] != b["router_sha256"]


def test_reader_rejects_a_non_capture(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a capture"):
        CaptureReader(tmp_path)
