"""OffloadedRoutedExperts: vLLM's ``RoutedExperts`` with the experts in the slow tier.

Registered with ``RoutedExperts.register_oot`` by the plugin, so every MoE model built
through ``FusedMoEFactory`` (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, DeepSeek-V2, ...)
gets it. When the engine's ``additional_config`` has no ``specexpert`` key the instance
turns itself into a plain ``RoutedExperts`` before initializing, so vLLM runs untouched.

Quantized checkpoints: the experts stay packed (see :mod:`.packed_experts`); vLLM's
unquantized method runs them from bf16 slots.

Weights: vLLM's own loader and quant method load them on the host, and the layer's
:class:`~.slow_tier.SlowTier` hands them to the :class:`OffloadEngine` as the slow tier
(what the ``lookahead`` draft's layers take: :mod:`.draft_sizing`). Execution goes
through one opaque custom op, ``torch.ops.specexpert.routed_experts``, so the
data-dependent cache logic is invisible to torch.compile.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)
from vllm.utils.torch_utils import direct_register_custom_op

from vllm_specexpert import vllm_hooks
from vllm_specexpert.architectures import check_supported, packed_format
from vllm_specexpert.config import SpecExpertConfig, SpecExpertUnsupportedError
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.layers import draft_sizing, failed_requests, lookahead_driver
from vllm_specexpert.layers.engines import engine_for
from vllm_specexpert.layers.forward_phase import current_phases
from vllm_specexpert.layers.int4_gemm import Int4GemmExperts
from vllm_specexpert.layers.slot_kernel import SlotKernel
from vllm_specexpert.layers.slow_tier import SlowTier
from vllm_specexpert.tiers import slow_tiers
from vllm_specexpert.tiers.expert_pack import DRAFT_PREFIX

FORWARD_CONTEXT_SUFFIX = ".specexpert"
"""Key suffix under which a layer registers in vLLM's static forward context."""


class OffloadedRoutedExperts(RoutedExperts):
    """Routed experts served from an :class:`ExpertCache` (see module doc)."""

    vanilla_class: type[RoutedExperts] = RoutedExperts
    """The vLLM class this one offloads (a model's own subclass, see :func:`offloaded`)."""
    w13_weight: torch.nn.Parameter
    w2_weight: torch.nn.Parameter
    """vLLM's expert parameters (``[E, ...]``; packed: a one-expert placeholder)."""

    def __init__(
        self,
        layer_name: str,
        params_dtype: torch.dtype,
        moe_config: Any,
        quant_config: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        vllm_config = get_current_vllm_config()
        config = SpecExpertConfig.from_additional_config(vllm_config.additional_config)
        if config is None:
            # Not configured: become exactly vLLM's layer.
            vanilla = self.vanilla_class
            self.__class__ = vanilla  # type: ignore[assignment]  # (becoming vLLM's class)
            vanilla.__init__(
                self, layer_name, params_dtype, moe_config, quant_config, *args, **kwargs
            )
            return

        check_supported(vllm_config)
        # The draft's layers are the checkpoint's modules under vLLM's draft prefix.
        experts_format = packed_format(vllm_config, layer_name.removeprefix(DRAFT_PREFIX))
        if moe_config.has_bias and experts_format is not None:
            raise SpecExpertUnsupportedError(
                f"{layer_name}: quantized experts with biases",
                "biased experts are offloaded in bf16 only for now",
                "use the bf16 checkpoint",
            )
        self._draft = layer_name.startswith(DRAFT_PREFIX) and config.lookahead is not None
        """This layer is the lookahead draft's: INT4 experts, its routes to the target."""
        model = vllm_config.model_config.model
        self.slow_tier = SlowTier(self, config, experts_format, self._draft, model)
        if self.slow_tier.from_tier:
            vllm_hooks.skip_routed_experts_when(_served_by_a_slow_tier)
            failed_requests.install()
        super().__init__(layer_name, params_dtype, moe_config, quant_config, *args, **kwargs)

        draft_packed = self.slow_tier.draft_packed
        own = (
            draft_sizing.draft_layer_config(config, moe_config, draft_packed)
            if self._draft
            else config
        )
        if own.budget_sized:  # fail early (a size or auto is sized at the first layer)
            own.slots_per_layer(self.global_num_experts, self.top_k)
        if config.path_predictor is not None:
            vllm_hooks.keep_step_demand()
        if config.lookahead is not None:
            lookahead_driver.install()
        self.slot_kernel: SlotKernel | Int4GemmExperts = (
            Int4GemmExperts(self.activation) if draft_packed else SlotKernel(self)
        )
        self.engine = engine_for(vllm_config, own, draft=self._draft)
        self.checkpoint: str = vllm_config.model_config.model
        """The model's directory (what a mesh peer reads its shard from)."""
        self.engine.budget.sizing.count_layer(
            moe_config.intermediate_size_per_partition,
            *draft_sizing.twin_bytes(
                config, layer_name, moe_config, vllm_config.model_config.dtype
            ),
        )
        self.decode_query_len = 1 + (config.lookahead.k_max if config.lookahead else 0)
        """Most tokens a decoding request is scheduled per pass (verification: 1 + k)."""
        self.layer_index = _layer_index(layer_name)
        self._context_key = layer_name + FORWARD_CONTEXT_SUFFIX
        forward_context = vllm_config.compilation_config.static_forward_context
        if self._context_key in forward_context:
            raise ValueError(f"duplicate layer name {self._context_key}")
        forward_context[self._context_key] = self

    # ------------------------------------------------------------------ loading

    def _get_quant_method(self, prefix: str, quant_config: Any, moe_config: Any) -> Any:
        # Packed experts are dequantized into bf16 slots: vLLM's unquantized method runs
        # them (its quantized MoE methods have no kernel on most CPUs).
        if self.slow_tier.packed_format is not None:
            quant_config = None
        method = super()._get_quant_method(prefix, quant_config, moe_config)
        if not isinstance(method, UnquantizedFusedMoEMethod) or method.is_monolithic:
            # This is the MoE backend vLLM picked, which must be a modular kernel run on
            # given weights.
            raise SpecExpertUnsupportedError(
                f"{prefix}: MoE method {type(method).__name__}",
                "only modular fused-MoE kernels can run experts from the slot pool",
                "use vLLM's default (Triton/CPU) MoE backend",
            )
        self.slow_tier.load_through(method, prefix)
        return method

    # ---------------------------------------------------------------- execution

    def forward_modular(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any = None,
        shared_experts_input: Any = None,
    ) -> torch.Tensor:
        # Shared experts only reach the kernel with EP prepare/finalize (async), which
        # check_layer_supported rejects; the runner runs them itself otherwise.
        if not torch.compiler.is_compiling():
            # Eager: nothing to hide from a tracer, the op's dispatch would only add
            # its cost.
            return self.offloaded_forward(x, topk_weights, topk_ids, None)
        # The output buffer is allocated here, outside the op: on CUDA the op is a
        # splitting op between piecewise CUDA graphs, and the next graph reads the
        # address it was captured with.
        out = torch.empty_like(x)
        torch.ops.specexpert.routed_experts(x, topk_weights, topk_ids, out, self._context_key)
        return out

    def offloaded_forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """The layer call, into ``out`` if given (the op's buffer): a kernel launch on
        all of the call's tokens writes there directly (:attr:`LayerCall.out`), else its
        result is copied in."""
        tokens = x.shape[0]
        phases = current_phases(tokens, self.decode_query_len)
        request = LayerCall(
            self.layer_name,
            self.slot_kernel,
            x,
            topk_weights,
            topk_ids,
            phases,
            out=out,
            tile_tokens=tokens,
        )
        result = self.engine.run_call(request)
        if out is not None and result is not out:
            out.copy_(result)
            return out
        return result


def offloaded(base: type[RoutedExperts]) -> type[OffloadedRoutedExperts]:
    """The offloaded layer for a model's own ``RoutedExperts`` subclass (GPT-OSS loads
    its fused expert tensors in one): vLLM's class for everything it defines, the
    offloaded layer's behaviour on top."""
    return type(
        f"Offloaded{base.__name__}",
        (OffloadedRoutedExperts, base),
        {"vanilla_class": base, "__module__": __name__},
    )


def _served_by_a_slow_tier(vllm_config: Any) -> bool:
    """vLLM loads none of the routed experts: a slow tier holds them."""
    config = SpecExpertConfig.from_additional_config(vllm_config.additional_config)
    model = vllm_config.model_config.model
    return config is not None and slow_tiers.configured(config, model) is not None


def _layer_index(layer_name: str) -> int:
    match = re.search(r"layers\.(\d+)\.", layer_name)
    return int(match.group(1)) if match else -1


# ------------------------------------------------------------------ custom op

ROUTED_EXPERTS_OP = "specexpert::routed_experts"
"""The op's qualified name (a CUDA-graph splitting op, see ``plugins``)."""


def _routed_experts_impl(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layer_key: str,
) -> None:
    get_forward_context().no_compile_layers[layer_key].offloaded_forward(
        x, topk_weights, topk_ids, out
    )


def _routed_experts_fake(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layer_key: str,
) -> None:
    return None


_LIBRARY = torch.library.Library("specexpert", "FRAGMENT")
direct_register_custom_op(
    "routed_experts",
    _routed_experts_impl,
    mutates_args=["out"],
    fake_impl=_routed_experts_fake,
    target_lib=_LIBRARY,
)
