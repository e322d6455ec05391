"""What a config needs of the model: slots per layer from the budget, and the settings
that depend on the model's routing shape and on how its experts are stored. Needs only
the model's config, so it runs in the calling process (``validate_engine_config``) and
again in the worker (start, ``reconfigure``)."""

from __future__ import annotations

import math

from vllm_specexpert.config.errors import SpecExpertConfigError
from vllm_specexpert.config.rules import Settings
from vllm_specexpert.config.sections import QualityConfig


def check_fits(
    config: Settings, num_experts: int, top_k: int, packed: str | None = None
) -> int | None:
    """The slots per MoE layer, once every setting that depends on the model's
    routing shape and on how its experts are stored (``packed``: their quantized
    format, ``None``: bf16/fp16) is checked. Needs only the model's config: run in
    the calling process (``validate_engine_config``) and again by the worker
    (start, ``reconfigure``). A budget not sized yet (a size, ``auto``) gives ``None``,
    and what depends on the slots is checked once the engine has sized it."""
    slots = None if isinstance(config.budget, str) else slots_per_layer(config, num_experts, top_k)
    if config.miss_policy_spec.low_bit:
        if packed is not None:
            raise SpecExpertConfigError(
                "miss_policy",
                f"'lowbit' runs INT4 copies of bf16 experts, and this "
                f"checkpoint's experts are already {packed}: there is no lower-bit copy "
                "to run",
                "use 'fetch', 'cpu' or 'auto'",
            )
        if slots is not None and slots < 2 * top_k:
            raise SpecExpertConfigError(
                "budget",
                f"'lowbit' keeps top_k ({top_k}) of each layer's {slots} "
                "slots for INT4 copies, leaving fewer than top_k for the rest",
                f"give a budget of at least {2 * top_k} slots per layer",
            )
    if config.disk is not None and packed is not None:
        raise SpecExpertConfigError(
            "disk",
            f"the expert pack holds bf16 experts, and this checkpoint's experts are "
            f"{packed} (quantized experts on disk are not built yet)",
            "use the bf16 checkpoint (`specexpert dequantize`), or remove disk",
        )
    mesh = config.mesh
    if mesh is not None:
        if packed is not None:
            raise SpecExpertConfigError(
                "mesh",
                f"a peer reads per-expert bf16/fp16 tensors from the checkpoint, "
                f"and this checkpoint's experts are {packed}",
                "use the bf16 checkpoint (`specexpert dequantize`), or remove mesh",
            )
        if mesh.placement == "replicate_hot" and mesh.hot_count >= num_experts:
            raise SpecExpertConfigError(
                "mesh.hot_count",
                f"{mesh.hot_count} is not fewer than the model's {num_experts} experts per layer",
                f"use hot_count < {num_experts}",
            )
        if (
            mesh.placement == "replicate_hot"
            and slots is not None
            and mesh.hot_count > slots - top_k
        ):
            raise SpecExpertConfigError(
                "mesh.hot_count",
                f"{mesh.hot_count} pinned experts leave fewer than "
                f"top_k ({top_k}) of the layer's {slots} slots for the others",
                f"use hot_count <= {slots - top_k}, or a larger budget",
            )
    if (
        config.quality is not None
        and config.quality != QualityConfig()  # (the default an approximate mode starts
        and slots == num_experts  # with: its monitor then finds nothing to judge)
        and not config.miss_policy_spec.speculates
    ):
        raise SpecExpertConfigError(
            "quality",
            f"the budget holds all {num_experts} experts of a layer: nothing "
            f"misses, so miss_policy '{config.miss_policy}' runs exactly and there is "
            "nothing to budget",
            "remove quality, or give a smaller budget",
        )
    return slots


def slots_per_layer(config: Settings, num_experts: int, top_k: int) -> int:
    """Number of device cache slots per MoE layer for a model with ``num_experts``
    routed experts per layer and ``top_k`` experts per token. Only for a sized budget
    (a fraction or a count): the engine sizes a size or ``auto``
    (:func:`~vllm_specexpert.config.sizing.fit_budget`) before it makes any slot."""
    if isinstance(config.budget, str):
        raise RuntimeError(f"budget {config.budget!r} is not sized yet (fit_budget)")
    return budget_slots(config.budget, num_experts, top_k)


def budget_slots(budget: float | int, num_experts: int, top_k: int) -> int:
    """Slots per layer of a fraction or a count, checked against the layer's shape."""
    if isinstance(budget, int):
        slots = budget
        given = f"budget {budget}"
    else:
        slots = math.floor(budget * num_experts + 1e-9)
        given = f"budget {budget} x {num_experts} experts = {slots} slots"
    if slots > num_experts:
        raise SpecExpertConfigError(
            "budget",
            f"{given} exceeds the {num_experts} routed experts per layer",
            f"use at most {num_experts} (or a fraction <= 1.0)",
        )
    if slots < top_k:
        raise SpecExpertConfigError(
            "budget",
            f"{given}, fewer than the model's top_k={top_k} experts per token "
            "(one token could not run)",
            f"use at least {top_k} slots, i.e. budget >= {top_k} "
            f"or >= {math.ceil(top_k / num_experts * 1000) / 1000}",
        )
    return slots
