"""The training tool's batched experts compute what transformers' per-expert loop
computes, outputs and gradients, including the overflow beyond an expert's capacity; its
load-balancing loss pushes every layer with the same force, whatever the depth."""

import pytest
import torch

from vllm_specexpert.tools import train_tiny


def tiny_model(implementation: str):
    from transformers import AutoModelForCausalLM

    config = train_tiny.TrainConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    ).hf_config()
    config.vocab_size = 64
    config._experts_implementation = implementation
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("capacity_factor", [1.5, 0.25])  # 0.25: most pairs overflow
def test_padded_experts_equal_the_per_expert_loop(monkeypatch, capacity_factor):
    train_tiny.register_padded_experts()
    monkeypatch.setattr(train_tiny, "CAPACITY_FACTOR", capacity_factor)
    eager, padded = tiny_model("eager"), tiny_model("padded_bmm")
    padded.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(1))
    losses = [m(input_ids=ids, labels=ids).loss for m in (eager, padded)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, a), (_, b) in zip(eager.named_parameters(), padded.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    # The experts did receive gradient (a vacuous match of zeros would pass above).
    grad = padded.model.layers[0].mlp.experts.gate_up_proj.grad
    assert float(grad.abs().sum()) > 0


def test_balance_loss_weighs_each_layer_fully_whatever_the_depth():
    """A collapsed layer adds the same penalty next to 1 or 7 balanced layers (averaging
    over layers diluted it 8x and left dead experts in a run)."""
    experts, tokens = 16, 512
    balanced = torch.zeros(tokens, experts)  # uniform router: Switch loss at its minimum
    collapsed = torch.zeros(tokens, experts)
    collapsed[:, :4] = 5.0  # every token to the same 4 experts
    loss = train_tiny.balance_loss
    assert float(loss([balanced], 4)) == pytest.approx(1.0)
    shallow = float(loss([collapsed], 4)) - float(loss([balanced], 4))
    deep = float(loss([collapsed] + [balanced] * 7, 4)) - float(loss([balanced] * 8, 4))
    assert shallow > 1.0  # the collapse is penalized ...
    assert deep == pytest.approx(shallow)  # ... as much in an 8-layer model
