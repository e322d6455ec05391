"""What needs only the settings, the model's config and its checkpoint's headers is
refused in the calling process, where vLLM builds the engine config: ``LLM()`` raises the
plugin's own error (not vLLM's "Engine core initialization failed"), ``serve`` exits with
one line, and nothing is started or left behind (no engine process, no Ray)."""

from __future__ import annotations

import socket

import pytest

from specexpert_testbed.fixtures import TRAINED_MODEL, model_path
from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.tools.embedded_model import TRAINED_CALIBRATION_DIR, TRAINED_ESTIMATOR_DIR

CALIBRATION = str(TRAINED_CALIBRATION_DIR)


def closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The trained model: 64 experts per layer, top-4 (budget 0.25: 16 slots).
CASES = {
    "lowbit with fewer than 2 x top_k slots": (
        TRAINED_MODEL,
        {"budget": 7, "miss_policy": "lowbit"},
        {},
        "budget",
    ),
    "lowbit on an AWQ checkpoint": (
        "qwen3_moe-awq",
        {"budget": 0.5, "miss_policy": "lowbit"},
        {},
        "miss_policy",
    ),
    "mesh on an AWQ checkpoint": ("qwen3_moe-awq", {"budget": 0.5, "mesh": {}}, {}, "mesh"),
    "mesh on fused experts": ("gpt_oss", {"budget": 0.5, "mesh": {}}, {}, "mesh"),
    "hot_count above the slots - top_k": (
        TRAINED_MODEL,
        {
            "budget": 0.25,
            "calibration": CALIBRATION,
            "mesh": {"placement": "replicate_hot", "hot_count": 13},
        },
        {},
        "mesh.hot_count",
    ),
    "hot_count of every expert": (
        TRAINED_MODEL,
        {
            "budget": 1.0,
            "calibration": CALIBRATION,
            "mesh": {"placement": "replicate_hot", "hot_count": 64},
        },
        {},
        "mesh.hot_count",
    ),
    "router_free in the compiled mode": (
        TRAINED_MODEL,
        {
            "budget": 0.25,
            "predictor": "estimator",
            "miss_policy": "speculate",
            "router_free": True,
            "calibration": CALIBRATION,
            "estimator": str(TRAINED_ESTIMATOR_DIR),
        },
        {"enforce_eager": False},
        "router_free",
    ),
    # 8 MoE layers of 96 KiB experts: 2 MB buys 2 slots per layer, top_k is 4.
    "a size budget below top_k": (TRAINED_MODEL, {"budget": "2MB"}, {}, "budget"),
    # deepseek_v2: 3 MoE layers (the first is dense) of 48 KiB experts: 0.5 MB buys
    # 3 slots (2 if every layer counted), top_k is 2 (not refused); 0.25 MB buys 1.
    "a size budget below top_k, a dense first layer": (
        "deepseek_v2",
        {"budget": "0.25MB"},
        {},
        "budget",
    ),
    "quality where nothing can miss": (
        TRAINED_MODEL,
        {"budget": 64, "miss_policy": "drop", "quality": {"window": 50}},
        {},
        "quality",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_where_the_engine_config_is_built(case):
    from vllm import EngineArgs

    model, specexpert, engine, field = CASES[case]
    engine = {"enforce_eager": True, **engine}
    args = EngineArgs(
        model=str(model_path(model)),
        max_model_len=512,
        additional_config={"specexpert": specexpert},
        **engine,
    )
    with pytest.raises(SpecExpertConfigError) as error:
        args.create_engine_config()
    assert error.value.field_name == field, str(error.value)


def test_an_unreachable_ray_address_is_refused_before_ray_starts():
    import ray
    from vllm import EngineArgs

    address = f"127.0.0.1:{closed_port()}"
    args = EngineArgs(
        model=str(model_path(TRAINED_MODEL)),
        max_model_len=512,
        enforce_eager=True,
        additional_config={"specexpert": {"budget": 0.25, "mesh": {"ray_address": address}}},
    )
    with pytest.raises(SpecExpertConfigError) as error:
        args.create_engine_config()
    assert error.value.field_name == "mesh.ray_address" and address in str(error.value)
    assert not ray.is_initialized()


LLM_SCRIPT = """
import sys
from vllm import LLM
from vllm_specexpert.config import SpecExpertConfigError
if __name__ == "__main__":
    try:
        LLM(model=sys.argv[1], max_model_len=512, enforce_eager=True,
            additional_config={"specexpert": {"budget": 7, "miss_policy": "lowbit"}})
    except SpecExpertConfigError as error:
        print("refused:", error.field_name)
        sys.exit(3)
"""


def test_llm_raises_the_plugins_own_error(tmp_path):
    # With vLLM's default engine-core process: a refusal in the worker reached the
    # caller only as "Engine core initialization failed. See root cause above.".
    import os
    import subprocess
    import sys

    script = tmp_path / "start.py"
    script.write_text(LLM_SCRIPT)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), str(model_path(TRAINED_MODEL))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 3 and "refused: budget" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize(
    "name", ["qwen3_moe-awq", "qwen3_moe-gptq", "qwen3_moe-w4a16", "qwen3_moe-fp8-block"]
)
def test_a_group_size_unlike_the_tensors_is_refused_from_the_headers(name, tmp_path):
    import json

    from vllm_specexpert.architectures import check_packed_tensors
    from vllm_specexpert.config import SpecExpertUnsupportedError
    from vllm_specexpert.quant_config import format_of

    source = model_path(name)
    config = json.loads((source / "config.json").read_text())
    check_packed_tensors(str(source), format_of(config["quantization_config"]))  # as made
    for file in source.iterdir():
        (tmp_path / file.name).symlink_to(file)
    (tmp_path / "config.json").unlink()
    quantization = config["quantization_config"]
    if "weight_block_size" in quantization:
        quantization["weight_block_size"] = [64, 64]
    elif "config_groups" in quantization:
        quantization["config_groups"]["group_0"]["weights"]["group_size"] = 64
    else:
        quantization["group_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    from vllm import EngineArgs

    args = EngineArgs(
        model=str(tmp_path),
        max_model_len=512,
        enforce_eager=True,
        additional_config={"specexpert": {"budget": 0.5}},
    )
    with pytest.raises(SpecExpertUnsupportedError) as error:
        args.create_engine_config()
    assert "quantization_config" in str(error.value) and "expected" in str(error.value)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v2"])
def test_the_callers_moe_layers_and_expert_bytes_are_the_checkpoints(name):
    # What the caller sizes a size budget with, from the model's config alone, against
    # the expert tensors in its checkpoint.
    import re

    from safetensors import safe_open
    from transformers import AutoConfig

    from vllm_specexpert.architectures import expert_nbytes, moe_layer_count

    path = model_path(name)
    expert_tensors: dict[int, dict[str, int]] = {}  # layer -> tensor -> bytes
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                found = re.match(r"model\.layers\.(\d+)\.[a-z_]+\.experts\.0\.", key)
                if found:
                    layer = expert_tensors.setdefault(int(found.group(1)), {})
                    layer[key] = f.get_tensor(key).nbytes
    hf_config = AutoConfig.from_pretrained(path)
    assert moe_layer_count(hf_config) == len(expert_tensors)
    assert expert_nbytes(hf_config, 2) == sum(expert_tensors[min(expert_tensors)].values())


def test_a_size_budget_that_buys_top_k_is_not_refused_in_the_caller():
    # (the control of the two size cases above: deepseek_v2 at 0.5 MB passes the caller)
    from vllm import EngineArgs

    args = EngineArgs(
        model=str(model_path("deepseek_v2")),
        max_model_len=512,
        enforce_eager=True,
        additional_config={"specexpert": {"budget": "0.5MB"}},
    )
    args.create_engine_config()
