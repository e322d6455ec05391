"""The neural expert estimator (speculating-experts §6.1, Appendix A): its network,
its KL distillation and its artifact; the runtime predictor is not wired yet."""

import json

import pytest
import torch

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.predict.estimator_network import (
    WEIGHTS_FILE,
    EstimatorShape,
    ExpertEstimator,
    load_estimator,
    save_estimator,
)
from vllm_specexpert.tools.train_estimator import estimator_recall, recall, train

H, E, K, J = 32, 16, 2, 3


def routed_data(tokens: int, seed: int) -> dict:
    """Router logits that are a fixed function of q, one per transition: a network that
    learns them predicts the top-k; one that does not stays near chance (K / E)."""
    g = torch.Generator().manual_seed(seed)
    gates = torch.randn(J, E, H, generator=torch.Generator().manual_seed(99))
    q = torch.randn(tokens, J, H, generator=g)
    logits = torch.einsum("njh,jeh->nje", q, gates) * 2
    return {"q": q, "router_logits": logits, "true_ids": logits.topk(K, dim=-1).indices}


def test_distillation_learns_each_transitions_router():
    shape = EstimatorShape(hidden_size=H, num_transitions=J, num_experts=E, top_k=K, latent=64)
    model, curve = train(
        routed_data(4096, 0),
        routed_data(1024, 1),
        shape,
        steps=600,
        eval_every=100,
        batch=256,
        lr=3e-3,
    )
    assert curve[0]["recall"] < 0.3  # untrained: about K / E = 0.125
    assert curve[-1]["recall"] > 0.8 and curve[-1]["training_tokens"] == 600 * 256
    # The transition embedding matters: transition 0's inputs through transition 1's
    # router are scored against transition 0's choices, and the estimator must tell.
    held = routed_data(1024, 2)
    own = estimator_recall(model, held["q"], held["true_ids"])
    swapped = estimator_recall(model, held["q"][:, [1, 0, 2]], held["true_ids"])
    assert own[0] > swapped[0] + 0.3


def test_recall_counts_the_routers_experts_found():
    truth = torch.tensor([[[1, 2]], [[3, 4]]])
    assert recall(torch.tensor([[[2, 1]], [[3, 9]]]), truth).tolist() == [0.75]


def make_artifact(tmp_path):
    shape = EstimatorShape(hidden_size=H, num_transitions=J, num_experts=E, top_k=K, latent=16)
    model = ExpertEstimator(shape, layer_indices=[0, 2, 3, 5]).eval()
    save_estimator(tmp_path, model, {"model": "toy"})
    return model


def test_the_artifact_reads_back_the_same_network(tmp_path):
    model = make_artifact(tmp_path)
    loaded = load_estimator(tmp_path)
    q = torch.randn(5, H)
    assert torch.equal(model(q, 2), loaded(q, 2)) and loaded.layer_indices == [0, 2, 3, 5]


@pytest.mark.parametrize("damage", ["nan", "truncated", "format", "indices"])
def test_a_damaged_artifact_is_one_error_naming_estimator(tmp_path, damage):
    from safetensors.torch import load_file, save_file

    make_artifact(tmp_path)
    weights, manifest = tmp_path / WEIGHTS_FILE, tmp_path / "manifest.json"
    if damage == "nan":
        state = load_file(str(weights))
        state["head.weight"][0, 0] = float("nan")
        save_file(state, str(weights))
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        meta = json.loads(manifest.read_text())
        if damage == "format":
            meta["format"] = "specexpert-estimator/0"
        else:
            meta["moe_layer_indices"] = [0, 2]
        manifest.write_text(json.dumps(meta))
    with pytest.raises(SpecExpertConfigError) as error:
        load_estimator(tmp_path)
    assert error.value.field_name == "estimator"


def test_an_estimator_of_another_model_is_refused(tmp_path):
    from specexpert_testbed.fixtures import TRAINED_MODEL, model_path

    make_artifact(tmp_path)
    meta = json.loads((tmp_path / "manifest.json").read_text())
    meta["model_fingerprint"] = {"hidden_size": 7}
    (tmp_path / "manifest.json").write_text(json.dumps(meta))
    with pytest.raises(SpecExpertConfigError) as error:
        load_estimator(tmp_path, model=str(model_path(TRAINED_MODEL)))
    assert error.value.field_name == "estimator" and "another model" in str(error.value)
