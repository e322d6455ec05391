"""A checkpoint's ``quantization_config`` (as Hugging Face writes it and vLLM reads it)
into the :mod:`~vllm_specexpert.quant_formats` format of its experts: :func:`format_of`
refuses, with one error naming what is supported, what the offloaded layer cannot
dequantize, and a malformed value with one error naming its key."""

from __future__ import annotations

from typing import Any

from vllm_specexpert.config import SpecExpertUnsupportedError
from vllm_specexpert.quant_formats import (
    SUPPORTED_GROUP_SIZES,
    AwqFormat,
    Fp8Format,
    GptqFormat,
    PackedFormat,
    PackQuantizedFormat,
)

SUPPORTED = (
    "awq (4-bit, zero point)",
    "gptq (4-bit)",
    "compressed-tensors pack-quantized W4A16",
    "compressed-tensors FP8 weights",
    "fp8 (per-tensor or block scales)",
)


def _unsupported(what: str, why: str) -> SpecExpertUnsupportedError:
    return SpecExpertUnsupportedError(
        f"quantization {what}",
        why,
        "offloaded experts can be " + ", ".join(SUPPORTED) + f" with group sizes "
        f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))}; or use a bf16 checkpoint",
    )


MALFORMED_FIX = (
    "correct quantization_config in the checkpoint's config.json (as its "
    "quantizer writes it), or use a bf16 checkpoint"
)


def _malformed(where: str, key: str, value: Any, expected: str) -> SpecExpertUnsupportedError:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return SpecExpertUnsupportedError(
        f"quantization_config {f'{where}{key}=' if key else ''}{shown}",
        f"it must be {expected}",
        MALFORMED_FIX,
    )


_REQUIRED = object()


def _value(
    config: dict[str, Any],
    keys: tuple[str, ...],
    kind: type,
    expected: str,
    default: Any = _REQUIRED,
    where: str = "",
) -> Any:
    """The value of the first of ``keys`` in ``config`` (a quantizer's spelling, then
    another's), of type ``kind``: a checkpoint's config is read, never coerced (vLLM
    would compute with a string group size), and one clear error says what is wrong."""
    for key in keys:
        if key in config and config[key] is not None:
            value = config[key]
            # bool is an int in Python, and not a bit width or a group size.
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise _malformed(where, key, value, expected)
            return value
    if default is _REQUIRED:
        raise SpecExpertUnsupportedError(
            f"quantization_config without {where}{keys[0]}", f"it must be {expected}", MALFORMED_FIX
        )
    return default


def _int(config: dict[str, Any], *keys: str, default: Any = _REQUIRED, where: str = "") -> int:
    return _value(config, keys, int, "an integer", default, where)


def _flag(config: dict[str, Any], key: str, default: bool, where: str = "") -> bool:
    return _value(config, (key,), bool, "true or false", default, where)


def _dict(config: dict[str, Any], key: str, where: str = "") -> dict[str, Any]:
    return _value(config, (key,), dict, "an object", {}, where)


def _names(config: dict[str, Any], *keys: str) -> tuple[str, ...]:
    """Module names the checkpoint leaves unquantized (the first of ``keys`` not empty)."""
    for key in keys:
        names = _value(config, (key,), list, "a list of module names", [])
        if not all(isinstance(name, str) for name in names):
            raise _malformed("", key, names, "a list of module names")
        if names:
            return tuple(names)
    return ()


def _group_size(method: str, value: int) -> int:
    if value not in SUPPORTED_GROUP_SIZES:
        raise _unsupported(f"'{method}' group_size {value}", "no dequantizer for it")
    return value


def format_of(config: dict[str, Any] | None) -> PackedFormat | None:
    """The :class:`PackedFormat` of a Hugging Face ``quantization_config`` (``None`` for
    an unquantized checkpoint); an error naming what is supported otherwise, or, for a
    malformed value (a missing bit width, a group size as a string...), naming it."""
    if not config:
        return None
    if not isinstance(config, dict):
        raise _malformed("", "", config, "an object")
    method = _value(config, ("quant_method",), str, "a string", "").lower()
    if method == "awq":
        bits = _int(config, "bits", "w_bit")
        if bits != 4:
            raise _unsupported(f"'awq' bits={bits}", "only 4-bit AWQ with zero points")
        if not _flag(config, "zero_point", True):
            # Symmetric AWQ checkpoints have no qzeros; the dequantizer reads them.
            raise _unsupported(
                "'awq' without zero points (zero_point: false)", "only 4-bit AWQ with zero points"
            )
        return AwqFormat(
            "awq",
            _names(config, "modules_to_not_convert"),
            _group_size(method, _int(config, "group_size", "q_group_size", default=-1)),
        )
    if method == "gptq":
        bits = _int(config, "bits")
        fmt = _value(config, ("checkpoint_format",), str, "a string", "gptq")
        if bits != 4 or fmt != "gptq":
            raise _unsupported(
                f"'gptq' bits={bits} format={config.get('checkpoint_format')}",
                "only 4-bit GPTQ in the v1 checkpoint format",
            )
        group_size = _int(config, "group_size", default=-1)
        if _flag(config, "desc_act", False) and group_size != -1:
            raise _unsupported(
                "'gptq' desc_act=true",
                "vLLM 0.32 refuses activation ordering (and so does the offloaded layer)",
            )
        skip = tuple(
            "re:" + k.removeprefix("-:") for k in _dict(config, "dynamic") if k.startswith("-:")
        )
        return GptqFormat("gptq", skip, _group_size(method, group_size), _flag(config, "sym", True))
    if method == "fp8":
        block = _value(config, ("weight_block_size",), list, "a list of two sizes", None)
        scheme = _value(config, ("activation_scheme",), str, "a string", "dynamic")
        if scheme != "dynamic":
            raise _unsupported(
                "'fp8' with static activation scales",
                "experts run with bf16 activations (weight-only)",
            )
        skip = _names(config, "ignored_layers", "modules_to_not_convert")
        if block:
            if len(block) != 2 or not all(
                isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block
            ):
                raise _malformed("", "weight_block_size", block, "a list of two sizes")
            return Fp8Format("fp8", skip, scales="block", block=(block[0], block[1]))
        return Fp8Format("fp8", skip, scales="tensor")
    if method == "compressed-tensors":
        return _compressed_tensors_format(config)
    raise _unsupported(f"'{method or config}'", "the offloaded layer has no dequantizer for it")


def _compressed_tensors_format(config: dict[str, Any]) -> PackedFormat:
    groups = _dict(config, "config_groups")
    if len(groups) != 1:
        raise _unsupported(
            f"compressed-tensors with {len(groups)} config groups",
            "one scheme for every quantized module is supported",
        )
    name, scheme = next(iter(groups.items()))
    if not isinstance(scheme, dict):
        raise _malformed("config_groups.", name, scheme, "an object")
    weights = _dict(scheme, "weights", where=f"config_groups.{name}.")
    if scheme.get("input_activations"):
        raise _unsupported(
            "compressed-tensors with quantized activations",
            "experts run with bf16 activations (weight-only)",
        )
    skip = _names(config, "ignore")
    fmt = scheme.get("format") or config.get("format")
    where = f"config_groups.{name}.weights."
    kind = _value(weights, ("type",), str, "a string", None, where)
    bits = _int(weights, "num_bits", default=0, where=where)
    strategy = _value(weights, ("strategy",), str, "a string", None, where)
    if fmt == "pack-quantized" and kind == "int" and bits == 4:
        group_size = (
            _int(weights, "group_size", default=-1, where=where) if strategy == "group" else -1
        )
        return PackQuantizedFormat(
            "pack-quantized",
            skip,
            _group_size("compressed-tensors", group_size),
            _flag(weights, "symmetric", True, where),
        )
    if kind == "float" and bits == 8 and strategy in ("tensor", "channel"):
        return Fp8Format("fp8", skip, scales=strategy)
    raise _unsupported(
        f"compressed-tensors {fmt} {kind}{bits} ({strategy})",
        "the offloaded layer has no dequantizer for it",
    )
