"""Packed formats against independent packers: vLLM's own AWQ/GPTQ test packers and
compressed-tensors' library (the bf16-twin tests cannot catch a packing error, since the
twin is made with the same dequantize), round trips, and reading quantization configs."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import (
    pack_to_int32,
    unpack_from_int32,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    awq_pack,
    gptq_pack,
)

from vllm_specexpert.config import SpecExpertUnsupportedError
from vllm_specexpert.quant_config import format_of
from vllm_specexpert.quant_formats import (
    AWQ_ORDER,
    AwqFormat,
    Fp8Format,
    GptqFormat,
    PackQuantizedFormat,
    pack_int4,
    unpack_int4,
)

OUT, IN = 64, 128


@pytest.fixture
def codes():
    return torch.randint(
        0, 16, (IN, OUT), generator=torch.Generator().manual_seed(0), dtype=torch.int32
    )


def test_awq_packing_is_vllms(codes):
    assert torch.equal(pack_int4(codes, -1, AWQ_ORDER), awq_pack(codes, 4, IN, OUT))
    assert torch.equal(unpack_int4(awq_pack(codes, 4, IN, OUT), -1, AWQ_ORDER), codes)


def test_gptq_packing_is_vllms(codes):
    assert torch.equal(pack_int4(codes, -2), gptq_pack(codes, 4, IN, OUT))
    assert torch.equal(unpack_int4(gptq_pack(codes, 4, IN, OUT), -2), codes)


def test_pack_quantized_is_compressed_tensors(codes):
    signed = (codes.T - 8).to(torch.int8)  # [out, in]
    assert torch.equal(pack_int4(codes.T, -1), pack_to_int32(signed, 4, packed_dim=1))
    zero = (codes[:8].T - 8).to(torch.int8)  # [out, 8 groups]
    assert torch.equal(pack_int4(codes[:8].T, -2), pack_to_int32(zero, 4, packed_dim=0))


@pytest.mark.parametrize("symmetric", [True, False])
def test_pack_quantized_dequantizes_as_compressed_tensors(symmetric):
    weight = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(1)) * 0.05
    fmt = PackQuantizedFormat("pack-quantized", (), 32, symmetric)
    tensors = fmt.quantize(weight)
    q = unpack_from_int32(tensors["weight_packed"], 4, torch.Size([OUT, IN])).float()
    zero = 0.0
    if not symmetric:
        zero = (
            unpack_from_int32(
                tensors["weight_zero_point"], 4, torch.Size([OUT, IN // 32]), packed_dim=0
            )
            .float()
            .repeat_interleave(32, dim=1)
        )
    scale = tensors["weight_scale"].float().repeat_interleave(32, dim=1)
    expected = ((q - zero) * scale).to(torch.bfloat16)
    assert torch.equal(fmt.dequantize(tensors, OUT, IN), expected)


FORMATS = [
    AwqFormat("awq", (), 32),
    AwqFormat("awq", (), -1),
    GptqFormat("gptq", (), 32),
    GptqFormat("gptq", (), 64, False),
    PackQuantizedFormat("pack-quantized", (), 32),
    PackQuantizedFormat("pack-quantized", (), 128, False),
    Fp8Format("fp8", (), "tensor"),
    Fp8Format("fp8", (), "channel"),
    Fp8Format("fp8", (), "block", (32, 32)),
    Fp8Format("fp8", (), "block", (48, 48)),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_round_trip_and_shapes(fmt):
    weight = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(2)) * 0.05
    tensors = fmt.quantize(weight)
    assert {
        k: (tuple(t.shape), t.dtype) for k, t in tensors.items() if k in fmt.tensor_shapes(OUT, IN)
    } == fmt.tensor_shapes(OUT, IN)
    assert fmt.features(tensors) == (OUT, IN)
    restored = fmt.dequantize(tensors, OUT, IN)
    assert restored.dtype == torch.bfloat16 and restored.shape == (OUT, IN)
    error = (restored.float() - weight).abs()
    # INT4: within half a step (range / 15, or 2 * amax / 14 symmetric) plus bf16
    # rounding; FP8 e4m3: 3 mantissa bits, within 1/16 of the value plus the same.
    if fmt.bits == 4:
        assert error.max() <= 0.2 / 15 * 1.1 + 0.004
    else:
        assert (error <= weight.abs() / 16 + 1e-3).all()
    # Batched (experts, projections) like the offloaded layer calls it.
    batched = {k: torch.stack([torch.stack([t, t])] * 3) for k, t in tensors.items()}
    assert torch.equal(fmt.dequantize(batched, OUT, IN)[2, 1], restored)


def test_bytes_per_weight_are_the_packed_bytes():
    assert AwqFormat("awq", (), 128).bytes_per_weight(OUT, IN) == (
        IN * OUT // 2 + (IN // 128) * OUT // 2 + (IN // 128) * OUT * 2
    )


def test_reading_quantization_configs():
    awq = format_of(
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 128,
            "zero_point": True,
            "modules_to_not_convert": ["self_attn"],
        }
    )
    assert isinstance(awq, AwqFormat) and awq.group_size == 128
    assert awq.skips("model.layers.0.self_attn.qkv_proj")
    assert not awq.skips("model.layers.0.mlp.experts")
    gptq = format_of(
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 64,
            "sym": False,
            "dynamic": {"-:.*mlp\\.experts.*": {}},
        }
    )
    assert isinstance(gptq, GptqFormat) and not gptq.symmetric
    assert gptq.skips("model.layers.0.mlp.experts")
    ct = format_of(
        {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "ignore": ["re:.*self_attn.*"],
            "config_groups": {
                "g": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "group",
                        "group_size": 32,
                    },
                }
            },
        }
    )
    assert isinstance(ct, PackQuantizedFormat) and ct.group_size == 32
    assert ct.skips("model.layers.3.self_attn.o_proj")
    fp8 = format_of(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    )
    assert isinstance(fp8, Fp8Format) and fp8.scales == "block"
    channel = format_of(
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
            },
        }
    )
    assert isinstance(channel, Fp8Format) and channel.scales == "channel"
    assert format_of(None) is None


def test_gptq_never_stores_a_zero_point_it_cannot_hold():
    # v1 stores z - 1: a group whose weights are all >= 0 (z = 0) would wrap to 15.
    weight = torch.rand(OUT, IN, generator=torch.Generator().manual_seed(3)) * 0.05
    fmt = GptqFormat("gptq", (), 32, symmetric=False)
    restored = fmt.dequantize(fmt.quantize(weight), OUT, IN)
    assert (restored.float() - weight).abs().max() <= 0.05 / 15 + 0.004


def test_awq_without_zero_points_is_refused_for_what_it_is():
    # It said "'awq' bits=4 is not supported", though 4 bits is what it supports.
    with pytest.raises(SpecExpertUnsupportedError, match="'awq' without zero points") as info:
        format_of({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False})
    assert "bits=4" not in str(info.value)


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}
CT = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "g": {
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
            }
        }
    },
}


def ct_weights(**change) -> dict:
    return {
        **CT,
        "config_groups": {"g": {"weights": {**CT["config_groups"]["g"]["weights"], **change}}},
    }


@pytest.mark.parametrize(
    "config, named",
    [
        ({**AWQ, "group_size": "128"}, "group_size='128'"),  # was accepted as 128
        ({**AWQ, "group_size": "g128"}, "group_size='g128'"),  # was a bare ValueError
        ({k: v for k, v in AWQ.items() if k != "bits"}, "without bits"),  # was taken as 4
        ({**AWQ, "bits": None}, "without bits"),  # was a bare TypeError
        ({**AWQ, "bits": 4.0}, "bits=4.0"),
        ({**AWQ, "zero_point": "false"}, "zero_point='false'"),  # a true string
        ({**AWQ, "modules_to_not_convert": "self_attn"}, "modules_to_not_convert='self_attn'"),
        ({**GPTQ, "bits": "4"}, "bits='4'"),
        ({k: v for k, v in GPTQ.items() if k != "bits"}, "without bits"),
        ({**GPTQ, "group_size": True}, "group_size=True"),
        ({**GPTQ, "dynamic": ["-:.*experts.*"]}, "dynamic="),  # was a bare AttributeError
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size=[128]"),
        ({"quant_method": "fp8", "weight_block_size": ["128", "128"]}, "weight_block_size="),
        ({"quant_method": 8}, "quant_method=8"),
        ({**CT, "config_groups": {"g": "int4"}}, "config_groups.g='int4'"),
        (ct_weights(num_bits="4"), "config_groups.g.weights.num_bits='4'"),
        (ct_weights(group_size="32"), "config_groups.g.weights.group_size='32'"),
        (ct_weights(symmetric="yes"), "config_groups.g.weights.symmetric='yes'"),
        ({**CT, "config_groups": {"g": {"weights": "w4"}}}, "config_groups.g.weights='w4'"),
        (["awq"], "quantization_config ['awq']"),
    ],
)
def test_a_malformed_quantization_config_is_one_clear_error(config, named):
    with pytest.raises(SpecExpertUnsupportedError) as info:
        format_of(config)
    message = str(info.value)
    assert named in message and "it must be" in message, message
    assert "config.json" in message and "\n" not in message


def test_well_formed_configs_read_as_before():
    # The strict reading keeps what quantizers write: AutoAWQ's spellings, a null group
    # size (one group per channel), an empty ignore list beside a filled one.
    autoawq = format_of(
        {
            "quant_method": "awq",
            "w_bit": 4,
            "q_group_size": 64,
            "zero_point": True,
            "version": "gemm",
        }
    )
    assert isinstance(autoawq, AwqFormat) and autoawq.group_size == 64
    assert format_of({**GPTQ, "group_size": None}).group_size == -1
    fp8 = format_of(
        {"quant_method": "fp8", "ignored_layers": [], "modules_to_not_convert": ["lm_head"]}
    )
    assert fp8.skips("lm_head")
    assert format_of({}) is None
