"""OffloadedRoutedExperts: vLLM's ``RoutedExperts`` with the experts in the slow tier.

Registered with ``RoutedExperts.register_oot`` by the plugin, so every MoE model built
through ``FusedMoEFactory`` (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, DeepSeek-V2, ...)
gets it. When the engine's ``additional_config`` has no ``specexpert`` key the instance
turns itself into a plain ``RoutedExperts`` before initializing, so vLLM runs untouched.

Quantized checkpoints: the experts stay packed (see :mod:`.packed_experts`); vLLM's
unquantized method runs them from bf16 slots.

Weights: the layer's parameters are created on the host (on CUDA, ``torch.device("cpu")``
around the quant method's ``create_weights`` only; pinned in place after loading), loaded
and post-processed there by vLLM's own loader and quant method
(``requires_device_loading = False``), then handed
to the :class:`OffloadEngine` as the slow tier. The device only ever holds the cache's
slot pool. Execution goes through one opaque custom op, ``torch.ops.specexpert.
routed_experts``, so the data-dependent cache logic is invisible to torch.compile.
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)
from vllm.platforms import current_platform
from vllm.utils.torch_utils import direct_register_custom_op

from vllm_specexpert import vllm_hooks
from vllm_specexpert.architectures import check_supported, packed_format
from vllm_specexpert.budget_plan import size_host_cache
from vllm_specexpert.config import (
    SpecExpertConfig,
    SpecExpertConfigError,
    SpecExpertUnsupportedError,
)
from vllm_specexpert.features.lookahead import LookaheadFeature
from vllm_specexpert.features.low_bit import LOW_BIT_SUFFIX
from vllm_specexpert.layer_call import LayerRequest
from vllm_specexpert.layers import failed_requests, int4_copies, lookahead_driver
from vllm_specexpert.layers.engines import current_target, engine_for, target_of
from vllm_specexpert.layers.forward_phase import current_phases
from vllm_specexpert.layers.int4_gemm import Int4GemmExperts
from vllm_specexpert.layers.pack_form_check import check_pack_form
from vllm_specexpert.layers.packed_experts import (
    PackedDecoder,
    PackedParameters,
    low_bit_parameters,
    runtime_form,
)
from vllm_specexpert.layers.slot_kernel import SlotKernel
from vllm_specexpert.tiers.disk import Disk, DiskExperts
from vllm_specexpert.tiers.expert_pack import DRAFT_PREFIX
from vllm_specexpert.tiers.host_cache import HostCache, HostCachedExperts
from vllm_specexpert.tiers.kernel_form import DTYPE_NAMES
from vllm_specexpert.tiers.mapped import MappedExperts
from vllm_specexpert.tiers.store import LayerExperts, SlotShapes

EXPERT_TENSORS = ("w13_weight", "w2_weight", "w13_bias", "w2_bias")
"""Per-expert tensors of a bf16 layer (the biases where the model has them, GPT-OSS)."""

FORWARD_CONTEXT_SUFFIX = ".specexpert"
"""Key suffix under which a layer registers in vLLM's static forward context."""


def _host_allocation() -> contextlib.AbstractContextManager:
    """Where the layer's parameters are allocated: host on GPU platforms."""
    if current_platform.is_cpu():
        return contextlib.nullcontext()
    return torch.device("cpu")


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
        self._packed_format = packed_format(vllm_config, layer_name.removeprefix(DRAFT_PREFIX))
        self._packed: PackedParameters | None = None
        if moe_config.has_bias and self._packed_format is not None:
            raise SpecExpertUnsupportedError(
                f"{layer_name}: quantized experts with biases",
                "biased experts are offloaded in bf16 only for now",
                "use the bf16 checkpoint",
            )
        self._on_disk = config.disk is not None
        """The experts are read from the disk tier's pack: vLLM loads none of them."""
        if self._on_disk:
            vllm_hooks.skip_routed_experts_when(_serves_experts_from_disk)
            failed_requests.install()
        super().__init__(layer_name, params_dtype, moe_config, quant_config, *args, **kwargs)

        self._draft = layer_name.startswith(DRAFT_PREFIX) and config.lookahead is not None
        """This layer is the lookahead draft's: INT4 experts, its routes to the target."""
        self._draft_packed = (
            self._draft
            and self._on_disk
            and int4_copies.Int4DraftForm(self.params_dtype).computed_packed(
                moe_config.hidden_dim, moe_config.intermediate_size_per_partition
            )
        )
        """This draft layer computes its INT4 experts packed: its slots hold them as the
        pack does, and are its only cache (no host rows)."""
        own = self._draft_config(config) if self._draft else config
        if own.budget_sized:  # fail early (a size or auto is sized at the first layer)
            own.slots_per_layer(self.global_num_experts, self.top_k)
        if config.path_predictor is not None:
            vllm_hooks.keep_step_demand()
        if config.lookahead is not None:
            lookahead_driver.install()
        self.slot_kernel: SlotKernel | Int4GemmExperts = (
            Int4GemmExperts(self.activation) if self._draft_packed else SlotKernel(self)
        )
        self.engine = engine_for(vllm_config, own, draft=self._draft)
        self.checkpoint: str = vllm_config.model_config.model
        """The model's directory (what a mesh peer reads its shard from)."""
        self.engine.budget.sizing.count_layer(
            moe_config.intermediate_size_per_partition,
            *self._draft_twin_bytes(config, moe_config, vllm_config.model_config.dtype),
        )
        self.decode_query_len = 1 + (config.lookahead.k_max if config.lookahead else 0)
        """Most tokens a decoding request is scheduled per pass (verification: 1 + k)."""
        self.layer_index = _layer_index(layer_name)
        self._context_key = layer_name + FORWARD_CONTEXT_SUFFIX
        forward_context = vllm_config.compilation_config.static_forward_context
        if self._context_key in forward_context:
            raise ValueError(f"duplicate layer name {self._context_key}")
        forward_context[self._context_key] = self

    def _draft_config(self, config: SpecExpertConfig) -> SpecExpertConfig:
        """The draft's engine config. Computed packed on the disk tier, its slots are its
        only cache: unless ``draft_budget`` says, as many per layer as
        ``lookahead.draft_cache`` gives (``auto``: the target's slots)."""
        if not self._draft_packed:
            return config.draft_config(self.top_k)
        target = current_target()
        plan = target.budget.current if target is not None else None
        assert plan is not None  # (vLLM loads the target before it builds the draft)
        experts, top_k = self.global_num_experts, self.top_k
        rows = config.draft_cache_rows(experts, top_k, plan.slots(experts, top_k))
        return config.draft_config(top_k, slots=rows)

    def _draft_twin_bytes(
        self, config: SpecExpertConfig, moe_config: Any, dtype: Any
    ) -> tuple[int, int, int, int]:
        """What this target layer's twin in the ``lookahead`` draft will take of the
        memory the slots are sized from (its slots, its INT4 experts on the CPU
        build), of the host's apart from it (CUDA: its INT4 experts, which the host
        cache is sized around), and per slot of this layer (its INT4 rows sized with the
        slots); 0s without a draft."""
        if config.lookahead is None or self._draft:
            return 0, 0, 0, 0
        num_experts = self.global_num_experts
        follow = config.draft_rows_follow_slots
        # Every INT4 expert in memory; on disk, its rows: a share, or (following the
        # slots) one per slot, counted per slot below; CUDA's host sizing, at most all.
        int4_experts = (
            num_experts
            if not self._on_disk or follow
            else config.draft_cache_rows(num_experts, self.top_k, num_experts)
        )
        hidden, intermediate = moe_config.hidden_dim, moe_config.intermediate_size_per_partition
        if self._on_disk and int4_copies.Int4DraftForm(dtype).computed_packed(
            hidden, intermediate
        ):  # its INT4 slots are its only cache: fixed, or one per slot of the target's
            expert = low_bit_parameters(self.layer_name, 1, hidden, intermediate).expert_nbytes
            if config.lookahead.draft_budget is None and follow:
                return 0, 0, 0, expert
            rows = config.draft_cache_rows(num_experts, self.top_k, num_experts)
            own = config.draft_config(self.top_k, slots=rows)
            return own.slots_per_layer(num_experts, self.top_k) * expert, 0, 0, 0
        slots, int4 = int4_copies.draft_twin_bytes(
            self.layer_name,
            num_experts,
            hidden,
            intermediate,
            config.draft_config(self.top_k).slots_per_layer(num_experts, self.top_k),
            int4_experts,
            dtype,
        )
        if not current_platform.is_cpu():  # (the draft's INT4 experts are the host's)
            return slots, 0, int4, 0
        if follow:
            return slots, 0, 0, int4 // num_experts
        return slots, int4, 0, 0

    # ------------------------------------------------------------------ loading

    def _get_quant_method(self, prefix: str, quant_config: Any, moe_config: Any) -> Any:
        # Packed experts are dequantized into bf16 slots: vLLM's unquantized method runs
        # them (its quantized MoE methods have no kernel on most CPUs).
        if self._packed_format is not None:
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
        # Allocate the expert weights on the host (only them: whatever else the layer
        # allocates stays on the device), and post-process them there: the method's
        # own instance is patched (typed Any: mypy forbids assigning to a method).
        patched: Any = method
        create_weights = method.create_weights

        def create_weights_on_host(
            layer: Any,
            num_experts: int,
            hidden_size: int,
            intermediate_size_per_partition: int,
            **kwargs: Any,
        ) -> None:
            with _host_allocation():
                if self._on_disk:
                    # One expert (vLLM's kernel setup): the pack holds them all.
                    return create_weights(
                        layer, 1, hidden_size, intermediate_size_per_partition, **kwargs
                    )
                if self._packed_format is None:
                    return create_weights(
                        layer, num_experts, hidden_size, intermediate_size_per_partition, **kwargs
                    )
                # One expert of bf16 parameters (vLLM's kernel setup), all experts packed.
                create_weights(layer, 1, hidden_size, intermediate_size_per_partition, **kwargs)
                self._packed = PackedParameters(
                    self._packed_format,
                    prefix,
                    num_experts,
                    hidden_size,
                    intermediate_size_per_partition,
                )
                self._packed.create(layer)

        patched.create_weights = create_weights_on_host
        patched.requires_device_loading = False
        post_process = method.process_weights_after_loading

        def process_weights_after_loading(layer: Any) -> None:
            packed = (self._packed, self._packed.take(layer)) if self._packed is not None else None
            # INT4 copies are made from vLLM's checkpoint layout, before its
            # post-processing (on CPU a prepacked layout: groups of it would mix rows):
            # lowbit's beside the experts, or the lookahead draft's instead of them.
            low_bit = None
            if self._draft and not self._on_disk:  # (on disk, the pack holds the draft's)
                packed = packed if int4_copies.keeps_packed(packed) else self._int4_copies(packed)
            elif packed is None and self.engine.config.miss_policy_spec.low_bit:
                low_bit = self._int4_copies(None)
            post_process(layer)
            self._move_experts_to_store(packed, low_bit)

        patched.process_weights_after_loading = process_weights_after_loading
        return method

    def _int4_copies(self, packed: int4_copies.Copies | None) -> int4_copies.Copies:
        """INT4 copies of this layer's experts from where they are: a quantized
        checkpoint's ``packed`` ones, or the loaded bf16 ones."""
        if packed is not None:
            return int4_copies.of_packed(self.layer_name, packed)
        weights = {name: getattr(self, name).data for name in EXPERT_TENSORS if hasattr(self, name)}
        return int4_copies.of_weights(self.layer_name, weights)

    def _move_experts_to_store(
        self,
        packed: int4_copies.Copies | None,
        low_bit: int4_copies.Copies | None = None,
    ) -> None:
        """Hand the runtime-format expert tensors (or the ``packed`` ones: a quantized
        checkpoint's, or the draft's INT4 copies) to the slow tier, with ``lowbit``'s
        INT4 copies if made; keep only views (packed: a one-expert placeholder). An
        expert is its weights and, where the model has them, its biases."""
        # What a slot holds: the runtime form of one expert.
        slot_shapes = {
            name: (tuple(getattr(self, name).shape[1:]), getattr(self, name).dtype)
            for name in EXPERT_TENSORS
            if hasattr(self, name)
        }
        form = functools.partial(runtime_form, self)
        experts: dict[str, torch.Tensor] | DiskExperts | MappedExperts | HostCachedExperts
        if self._on_disk and self._draft:
            experts, decoder = self._draft_experts_on_disk(form, slot_shapes)
        elif self._on_disk:
            disk = self.engine.store.disk
            assert isinstance(disk, Disk)  # (opened with the engine when the config has one)
            if self.engine.device.type == "cuda" and disk.host_cache is None:
                # (at the first layer, once vLLM's settings and the MoE layers are known)
                fit = size_host_cache(
                    self.engine.config,
                    self.engine.budget.sizing,
                    disk.layer(self.layer_name),
                    self.top_k,
                )
                disk.host_cache = HostCache(fit.slots_per_layer, pinned=True)
            experts = disk.layer(self.layer_name)
            check_pack_form(self, experts, slot_shapes, self.checkpoint)
            decoder = None
        elif packed is None:
            experts = {name: getattr(self, name).data for name in slot_shapes}
            decoder = None
        else:
            parameters, experts = packed
            decoder = PackedDecoder(parameters, form, slot_shapes)
            for name in slot_shapes:  # the kernel runs on slots: keep one expert's shape
                getattr(self, name).data = getattr(self, name).data[:1].clone()
        if low_bit is not None:  # beside the layer's experts, found there by the layer
            parameters, copies = low_bit
            self.engine.store.add_layer(
                self.layer_name + LOW_BIT_SUFFIX,
                copies,
                PackedDecoder(parameters, form, slot_shapes),
            )
        layer = self.engine.add_layer(
            self.layer_name,
            experts,
            self.top_k,
            index=self.layer_index,
            host_kernel=self.slot_kernel.host_kernel(),
            decoder=decoder,
            pool_reach=self.slot_kernel.pool_reach,
        )
        if packed is None and isinstance(layer.experts, LayerExperts):
            # The parameters now alias the store's (pinned) tensors instead of a copy.
            for name, tensor in layer.experts.tensors.items():
                getattr(self, name).data = tensor

    def _draft_experts_on_disk(
        self, form: Any, slot_shapes: SlotShapes
    ) -> tuple[DiskExperts | MappedExperts | HostCachedExperts, PackedDecoder | None]:
        """The draft's INT4 experts in the target's pack: read straight into its slots
        where it computes them packed, else through its host rows
        (``lookahead.draft_cache``, made at its first layer) and decoded; refused if the
        pack holds them in another layout than this build's."""
        target = target_of(self.engine)
        disk = target.store.disk
        assert isinstance(disk, Disk)  # (the target's, opened with its engine)
        moe = self.moe_config
        hidden, intermediate = moe.hidden_dim, moe.intermediate_size_per_partition
        record = disk.record_of(self.layer_name)
        dtype = self.w13_weight.dtype
        checkpoint = [
            ("w13_weight", (2 * intermediate, hidden), dtype),
            ("w2_weight", (hidden, intermediate), dtype),
        ]
        form_specs = int4_copies.Int4DraftForm(dtype).specs(checkpoint)
        want = {name: (list(shape), DTYPE_NAMES[d]) for name, shape, d in form_specs}
        have = {t.name: (t.shape, t.dtype) for t in record.tensors}
        if have != want:
            raise SpecExpertConfigError(
                "disk.path",
                f"{disk.pack.path}: the draft's experts of {self.layer_name} are {have}, "
                f"this build's INT4 draft reads {want}",
                f"`specexpert pack {self.checkpoint} --out {disk.pack.path} --draft` writes "
                "them again",
            )
        if self._draft_packed:  # (its slots are its cache: read into them, no rows)
            return disk.layer(self.layer_name), None
        parameters = low_bit_parameters(
            self.layer_name, self.global_num_experts, hidden, intermediate
        )
        decoder = PackedDecoder(parameters, form, slot_shapes)
        if disk.draft_cache is None:
            plan = target.budget.current
            assert plan is not None  # (the target's layers were equipped first)
            target_slots = plan.slots(self.global_num_experts, self.top_k)
            rows = target.config.draft_cache_rows(self.global_num_experts, self.top_k, target_slots)
            disk.draft_cache = HostCache(rows, pinned=False)
        return disk.layer(self.layer_name, decoder), decoder

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
        """The layer call, into ``out`` if given (the op's buffer): the call's first
        kernel launch on all of its tokens writes there directly (see
        :attr:`SlotKernel.call_out`), else its result is copied in."""
        if self._draft:
            lookahead = target_of(self.engine).feature(LookaheadFeature)
            if lookahead is not None and lookahead.active:
                # The draft's routes in a round: the target's lookahead (on CUDA, a sync).
                lookahead.draft_routed(
                    self.layer_index, topk_ids.cpu().numpy(), topk_weights.float().cpu().numpy()
                )
        kernel = self.slot_kernel
        kernel.begin_call(x, out)
        try:
            phases = current_phases(x.shape[0], self.decode_query_len)
            request = LayerRequest(self.layer_name, kernel, x, topk_weights, topk_ids, phases)
            result = self.engine.run_call(request)
        finally:
            kernel.end_call()
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


def _serves_experts_from_disk(vllm_config: Any) -> bool:
    config = SpecExpertConfig.from_additional_config(vllm_config.additional_config)
    return config is not None and config.disk is not None


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
