"""Quantized checkpoints: experts kept and moved packed, dequantized into bf16 slots.

Per format: the plugin on the quantized checkpoint against vanilla vLLM on its bf16 twin
(``specexpert dequantize``: the same dequantize), greedy, bit for bit, with the experts
fetched on misses and computed on the host. Vanilla vLLM cannot run these checkpoints on
this CPU at all (no AMX: no quantized MoE kernel), so the twin is the reference.
"""

import json

import pytest
import torch
from vllm_harness import (
    PROMPTS,
    following_param,
    greedy,
    make_llm,
    shutdown,
    skip_unless_batch_invariant,
    vanilla_reference,
    vanilla_reference_ahead,
)

import vllm_specexpert
from specexpert_testbed.fixtures import QUANTIZED_FIXTURES, TWIN_SUFFIX, model_path
from vllm_specexpert import quant_config
from vllm_specexpert.config import SpecExpertConfigError, SpecExpertUnsupportedError

FORMATS = [
    "qwen3_moe-awq",
    "qwen3_moe-gptq",
    "qwen3_moe-w4a16",
    "qwen3_moe-fp8-block",
    pytest.param("qwen3_moe-fp8", marks=pytest.mark.slow),
    pytest.param("qwen3_moe-fp8-channel", marks=pytest.mark.slow),
]
BF16_EXPERT_BYTES = 3 * 64 * 128 * 2
"""One expert of the qwen3_moe fixture in bf16: three 64 x 128 projections."""


@pytest.fixture(scope="module", params=FORMATS)
def engines(request):
    name = request.param
    # The other process runs this format's reference and the next's while this engine
    # starts.
    vanilla_reference_ahead(name + TWIN_SUFFIX)
    following = following_param(request)
    if following is not None:
        vanilla_reference_ahead(following + TWIN_SUFFIX)
    llm = make_llm(name, specexpert={"budget": 0.5})
    yield name, llm, vanilla_reference(name + TWIN_SUFFIX)
    shutdown(llm)


def test_twin_differs_from_the_unquantized_model():
    # The comparison below could not tell a dequantized expert from the original one
    # if quantizing changed nothing the model computes.
    twin = vanilla_reference("qwen3_moe-awq" + TWIN_SUFFIX)
    original = vanilla_reference("qwen3_moe")
    assert [c.token_ids for c in twin] != [c.token_ids for c in original]


@pytest.mark.parametrize("budget", [0.5, 0.25])
def test_quantized_experts_match_vanilla_on_the_bf16_twin(engines, budget):
    _, llm, reference = engines
    vllm_specexpert.reconfigure(llm, budget=budget, miss_policy="fetch")
    vllm_specexpert.reset_stats(llm)
    outputs = greedy(llm)
    assert [c.token_ids for c in outputs] == [c.token_ids for c in reference]
    assert [c.logprobs for c in outputs] == [c.logprobs for c in reference]
    assert vllm_specexpert.get_stats(llm)[0]["total"]["decode"]["loads"] > 0


def test_host_compute_dequantizes_packed_experts(engines):
    # `cpu` adds host and device partial sums in another order than one kernel does
    # (an "equivalent" mode): the same tokens up to a near tie of the reference (the
    # random fixtures have some), logprobs within bf16 rounding until then.
    name, llm, reference = engines
    vllm_specexpert.reconfigure(llm, budget=0.25, miss_policy="cpu", admit_host_experts=False)
    vllm_specexpert.reset_stats(llm)
    outputs = greedy(llm)
    compared, diffs = 0, []
    for out, ref in zip(outputs, reference, strict=True):
        for token, ref_token, lp, ref_lp in zip(
            out.token_ids, ref.token_ids, out.logprobs, ref.logprobs, strict=True
        ):
            top, second = sorted(ref_lp.values(), reverse=True)[:2]
            if token != ref_token:
                assert top - second < 0.05, (name, compared)  # a flip, not a near tie
                break
            diffs.append(abs(lp[token] - ref_lp[token]))
            compared += 1
    assert compared >= len(reference) * len(reference[0].token_ids) // 2
    assert max(diffs) < 0.25
    decode = vllm_specexpert.get_stats(llm)[0]["total"]["decode"]
    assert decode["host_entries"] > 0 and decode["loads"] == 0


@pytest.mark.parametrize(
    "name",
    [
        "qwen3_moe-w4a16",
        "qwen3_moe-fp8-block",
        pytest.param("qwen3_moe-awq", marks=pytest.mark.slow),
        pytest.param("qwen3_moe-gptq", marks=pytest.mark.slow),
    ],
)
def test_lookahead_drafts_from_the_checkpoints_experts_and_stays_exact(name):
    # The draft's INT4 experts: a 4-bit checkpoint's own (the draft is the checkpoint,
    # and accepts every token), an FP8 checkpoint's quantized again to INT4. vLLM builds
    # the draft's layers under its own prefix: the checkpoint's list of unquantized
    # modules (exact names for compressed-tensors and FP8) must still name them.
    reference = vanilla_reference(name + TWIN_SUFFIX)
    # (a fixed length: the governor drafts nothing in a run this short)
    llm = make_llm(name, specexpert={"budget": 0.5, "lookahead": {"k": 3}})
    try:
        outputs = greedy(llm)
        stats = vllm_specexpert.get_stats(llm)[0]
        lookahead = stats["lookahead"]
        assert lookahead["drafted"] > 0 and lookahead["acceptance"] > 0.5
        draft_bytes = lookahead["draft"]["int4_bytes"]
        if QUANTIZED_FIXTURES[name]["name"] == "fp8":
            assert draft_bytes < 0.6 * stats["store_bytes"]
            assert lookahead["acceptance"] < 1.0  # (another rounding than the target's)
        else:
            assert draft_bytes == stats["store_bytes"]
            assert lookahead["acceptance"] == 1.0
        skip_unless_batch_invariant("lookahead's tokens equal vanilla's on the bf16 twin")
        assert [c.token_ids for c in outputs] == [c.token_ids for c in reference]
        assert [c.logprobs for c in outputs] == [c.logprobs for c in reference]
    finally:
        shutdown(llm)


def test_experts_move_packed(engines):
    name, llm, _ = engines
    vllm_specexpert.reconfigure(llm, budget=0.25, miss_policy="fetch")
    vllm_specexpert.reset_stats(llm)
    greedy(llm, prompts=PROMPTS[:1])
    stats = vllm_specexpert.get_stats(llm)[0]
    spec = QUANTIZED_FIXTURES[name]
    fmt = {"w4a16": "pack-quantized"}.get(spec["name"], spec["name"])
    assert set(stats["expert_format"].values()) == {fmt}
    expert_bytes = set(stats["expert_bytes"].values())
    assert set(stats["slot_bytes"].values()) == {BF16_EXPERT_BYTES}
    # INT4: a quarter of bf16 plus scales; FP8: half plus scales.
    limit = 0.35 if spec["name"] != "fp8" else 0.55
    assert max(expert_bytes) < limit * BF16_EXPERT_BYTES
    decode = stats["total"]["decode"]
    assert decode["bytes_loaded"] == decode["loads"] * max(expert_bytes)
    assert f"{fmt} experts of" in stats["summary"]


# ---------------------------------------------------------------- bad checkpoints


def test_unsupported_quantizations_name_what_is_supported():
    with pytest.raises(SpecExpertUnsupportedError, match=r"group_size 48.*32, 64, 128, -1"):
        quant_config.format_of(
            {"quant_method": "awq", "bits": 4, "group_size": 48, "zero_point": True}
        )
    with pytest.raises(SpecExpertUnsupportedError, match=r"'mxfp4'.*awq \(4-bit"):
        quant_config.format_of({"quant_method": "mxfp4"})
    with pytest.raises(SpecExpertUnsupportedError, match="gptq' bits=8"):
        quant_config.format_of({"quant_method": "gptq", "bits": 8, "group_size": 128})
    with pytest.raises(SpecExpertUnsupportedError, match="static activation"):
        quant_config.format_of({"quant_method": "fp8", "activation_scheme": "static"})


def test_a_tensor_unlike_its_config_is_named_with_both_shapes(tmp_path):
    from safetensors.torch import load_file, save_file

    from vllm_specexpert.tools.harness import start_engine

    source = model_path("qwen3_moe-awq")
    for path in source.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    name = "model.layers.1.mlp.experts.3.up_proj.scales"
    tensors[name] = torch.ones(2, 64, dtype=torch.float16)  # config: [4, 64]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception) as failure:
        start_engine(str(tmp_path), {"budget": 0.5}, max_model_len=256)
    message = str(failure.value)
    assert "up_proj.scales" in message or "w13_scales" in message, message
    assert "[2, 64]" in message and "[4, 64]" in message, message


def test_quantize_cli_refuses_a_group_size_that_does_not_divide(tmp_path):
    from vllm_specexpert.tools import quantize

    fmt = quantize.make_format("awq", group_size=128)
    with pytest.raises(SystemExit, match=r"64 input features.*--group-size 128"):
        quantize.quantize_checkpoint(model_path("qwen3_moe"), tmp_path / "q", fmt, "awq")


def test_quantized_config_lists_every_unquantized_module():
    config = json.loads((model_path("qwen3_moe-awq") / "config.json").read_text())
    skipped = config["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.self_attn.q_proj" in skipped and "model.layers.3.mlp.gate" in skipped
    assert not any("experts" in name for name in skipped)


def test_lowbit_refuses_an_already_quantized_checkpoint(engines):
    name, llm, _ = engines
    fmt = {"w4a16": "pack-quantized"}.get(
        QUANTIZED_FIXTURES[name]["name"], QUANTIZED_FIXTURES[name]["name"]
    )
    with pytest.raises(SpecExpertConfigError, match=f"miss_policy.*already {fmt}"):
        vllm_specexpert.reconfigure(llm, miss_policy="lowbit")


def test_an_unsupported_quantization_is_refused_at_start(tmp_path):
    from vllm_specexpert.tools.harness import start_engine

    source = model_path("qwen3_moe-awq")
    for path in source.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"]["group_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecExpertUnsupportedError, match=r"group_size 48.*32, 64, 128, -1"):
        start_engine(str(tmp_path), {"budget": 0.5}, max_model_len=256)
