"""SlotKernel: one layer's fused experts, run by vLLM's own kernel on tensors that hold
some of the layer's experts (the device's slot pool, or the host store for host compute).

It computes a slice of the layer call with the kernel vanilla vLLM would run for the
whole layer, so an exact mode's output is vanilla's bit for bit: on CPU
``cpu_fused_moe`` called directly on slot indices; on CUDA the modular kernel with an
``expert_map`` and vanilla's tile config for the whole call.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from vllm.platforms import current_platform

from vllm_specexpert.tiers.host import GATED_ACTIVATIONS, HostKernel, torch_experts

CPU_POOL_REACH = 2**31 - 1
"""Elements of one weight tensor vLLM's CPU fused-MoE kernel can address: it computes
an expert's offset in 32 bits and reads past this (checked: a pool of 110 slots of
Qwen3-style experts widened to ``I = 40960`` crashes at slot 105, not at slot 50)."""


class SlotKernel:
    """The fused experts of ``layer`` (a vLLM ``RoutedExperts``) on given expert tensors:
    an :class:`~vllm_specexpert.layer_call.ExpertKernel`, holding no state of a call."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        """vLLM's layer: its quant method's kernel, activation and bias configs."""
        self._tile_configs: dict[int, dict] = {}
        self._direct: Any = None
        self._fused_moe: tuple[Any, str, str] | None = None
        self._bias_configs: list[Any] | None = None
        self._resolved = False

    @property
    def pool_reach(self) -> int | None:
        """Most elements of a slot-pool tensor this kernel addresses (``None``: CUDA's
        Triton kernel, no such limit)."""
        return CPU_POOL_REACH if current_platform.is_cpu() else None

    def __call__(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        ids: torch.Tensor,
        slots: dict[str, torch.Tensor],
        expert_map: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
        tile_tokens: int = 0,
    ) -> torch.Tensor:
        """On the CPU build ``ids`` are slot indices; on CUDA they are the router's ids
        and ``expert_map`` finds their slots (-1: not resident, contributes zero).
        ``out``: written on the CPU build (CUDA's modular kernel allocates its own)."""
        w13, w2 = slots["w13_weight"], slots["w2_weight"]
        biased = "w13_bias" in slots
        if biased:
            self._point_biases_at(slots)
        experts = self.direct_experts()
        if experts is not None:
            if out is None:
                out = torch.empty_like(x)
            if self._fused_moe is not None:  # what experts.apply runs, without wrappers
                op, activation, isa = self._fused_moe
                op(
                    out,
                    x,
                    w13,
                    w2,
                    experts.w1_bias if biased else None,
                    experts.w2_bias if biased else None,
                    topk_weights,
                    ids,
                    False,
                    activation,
                    isa,
                )
            else:
                experts.apply(
                    out,
                    x,
                    w13,
                    w2,
                    topk_weights,
                    ids,
                    self.layer.activation,
                    w13.shape[0],
                    None,
                    None,
                    None,
                    _NO_WORKSPACE,
                    _NO_WORKSPACE,
                    None,
                    False,
                )
            return out
        layer = self.layer
        with self._vanilla_tile_config(x, tile_tokens):
            return layer.quant_method.moe_kernel.apply(
                hidden_states=x,
                w1=w13,
                w2=w2,
                topk_weights=topk_weights,
                topk_ids=ids,
                activation=layer.activation,
                apply_router_weight_on_input=layer.apply_router_weight_on_input,
                global_num_experts=w13.shape[0] if expert_map is None else expert_map.numel(),
                expert_map=expert_map,
            )

    def direct_experts(self) -> Any:
        """vLLM's CPU experts object, when the modular kernel around it only adds Python
        overhead (no-DP/EP prepare/finalize, own scratch): the same ``cpu_fused_moe``
        on the same inputs. ``None`` elsewhere."""
        if not self._resolved:
            self._resolve_direct()
        return self._direct

    def host_kernel(self) -> HostKernel | None:
        """Fused experts on the store's host tensors (``cpu``/``auto`` miss policies).
        CPU build: this kernel (the store has the slots' layout). Elsewhere:
        :func:`torch_experts` for the gated activations it implements, else ``None``."""
        if current_platform.is_cpu():
            return self
        layer = self.layer
        activation = getattr(layer.activation, "value", str(layer.activation))
        if activation not in GATED_ACTIVATIONS or layer.apply_router_weight_on_input:
            return None
        return functools.partial(torch_experts, activation=activation)

    def _resolve_direct(self) -> None:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
            CPUUnquantizedExperts,
        )
        from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
            MoEPrepareAndFinalizeNoDPEPModular,
        )

        layer = self.layer
        impl: Any = getattr(layer.quant_method.moe_kernel, "impl", None)
        direct = (
            isinstance(getattr(impl, "fused_experts", None), CPUUnquantizedExperts)
            and isinstance(impl.prepare_finalize, MoEPrepareAndFinalizeNoDPEPModular)
            and not layer.apply_router_weight_on_input
        )
        self._direct = impl.fused_experts if direct else None
        # ``apply`` of vLLM's CPU experts only hands its arguments to the ``cpu_fused_moe``
        # op through two Python wrappers: the op itself, with the same arguments, unless
        # a subclass or zentorch runs something else.
        if (
            direct
            and type(self._direct).apply is CPUUnquantizedExperts.apply
            and not getattr(self._direct, "_use_zentorch", True)
        ):
            self._fused_moe = (
                torch.ops._C.cpu_fused_moe.default,
                layer.activation.value,
                self._direct.isa,
            )
        self._resolved = True

    def _point_biases_at(self, tensors: dict[str, torch.Tensor]) -> None:
        """The kernel reads expert biases from its quant config: point them at the biases
        of the tensors it runs on now (slots, or the store's), indexed like the weights."""
        if self._bias_configs is None:  # the kernel is built at load: look once
            method = self.layer.quant_method
            configs = (
                method.moe_quant_config,
                getattr(method.moe_kernel.fused_experts, "quant_config", None),
            )
            self._bias_configs = list({id(c): c for c in configs if c}.values())
        for config in self._bias_configs:
            config._w1.bias, config._w2.bias = tensors["w13_bias"], tensors["w2_bias"]

    def _vanilla_tile_config(
        self, x: torch.Tensor, tile_tokens: int
    ) -> contextlib.AbstractContextManager:
        """On GPUs: vanilla's Triton tile config for the whole call, looked up by the
        layer's expert count (not the slot count) and the call's token count (not a
        group's): another tile (BLOCK_SIZE_K) would sum a token's products in another
        order."""
        if current_platform.is_cpu():
            return contextlib.nullcontext()
        from vllm.model_executor.layers.fused_moe import override_config
        from vllm.model_executor.layers.fused_moe.fused_moe import (
            try_get_optimal_moe_config,
        )

        tokens = max(tile_tokens, x.shape[0])
        config = self._tile_configs.get(tokens)
        if config is None:
            # Every expert's shape (packed layers hold a one-expert placeholder).
            layer = self.layer
            experts = layer.global_num_experts
            quant_config = layer.quant_method.moe_quant_config
            config = self._tile_configs[tokens] = try_get_optimal_moe_config(
                (experts, *layer.w13_weight.shape[1:]),
                (experts, *layer.w2_weight.shape[1:]),
                layer.top_k,
                quant_config.config_name(x.dtype),
                tokens,
            )
        return override_config(config)


_NO_WORKSPACE = torch.empty(0)
