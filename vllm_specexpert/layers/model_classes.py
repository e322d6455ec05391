"""vLLM's MoE model classes with one addition: after loading, the offloaded MoE layers
are wired for prediction.

The plugin registers these under vLLM's own architecture names. Each is a subclass of
vLLM's class that, when ``additional_config`` has no ``specexpert`` key, turns back into
vLLM's class right after construction (so vLLM runs untouched). When configured, its
``process_weights_after_loading`` (vLLM's model-level post-load hook) calls
:func:`wire_model`, which tells the engine, for each offloaded MoE layer, which MoE layer
comes next and how that layer routes (its ``post_attention_layernorm``, gate and
router), and hands it the calibration's default vectors and residual scales for
``quasi_hidden``. The model's forward graph is left as vLLM built it.
"""

from __future__ import annotations

import importlib
import itertools
from typing import Any

import numpy as np
import torch
from torch import nn
from vllm.platforms import current_platform

from vllm_specexpert import vllm_hooks
from vllm_specexpert.architectures import SUPPORTED_ARCHITECTURES
from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts, offloaded
from vllm_specexpert.layers.router_free import RouterFreeHook, runner_is_eager
from vllm_specexpert.log import init_logger
from vllm_specexpert.predict import (
    FusedRouting,
    NextLayerRouting,
    PredictorInputs,
    residual_scale,
)
from vllm_specexpert.tiers.expert_pack import DRAFT_PREFIX

logger = init_logger(__name__)

VllmModule = Any
"""One of vLLM's model modules: read by attribute (``mlp.experts``, ``post_attention_layernorm``,
...), whose names differ by architecture: typed loosely on purpose."""


def _routing_of(decoder_layer: VllmModule) -> NextLayerRouting:
    """Layer ``decoder_layer``'s routing for the predictor: its own gate and router, so
    scoring, grouping and renormalisation follow the model. The RMS norm is written out
    with plain tensor ops on the layer's weight (vLLM's module dispatches through
    several Python layers per call, too slow for the decode path; a prediction need not
    be bit-exact)."""
    runner = decoder_layer.mlp.experts
    gate = runner.gate or getattr(decoder_layer.mlp, "gate", None) or decoder_layer.mlp.router
    norm = decoder_layer.post_attention_layernorm
    norm_weight = norm.weight.data.float()
    eps = norm.variance_epsilon

    def rms_norm(hidden: torch.Tensor) -> torch.Tensor:
        shape = (hidden.shape[-1],)
        return torch.nn.functional.rms_norm(hidden.float(), shape, norm_weight, eps).to(
            hidden.dtype
        )

    # The gate and selection as vLLM built them: ``router_free`` wraps the instance's
    # later, for the layer's own calls only (these are the previous layer's).
    gate_forward, select_experts = gate.forward, runner.router.select_experts

    def route_logits(
        hidden: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(hidden_states=hidden, router_logits=logits)

    def route(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = gate_forward(hidden)  # the module's: on CPU its weight is prepacked for oneDNN
        return route_logits(hidden, logits[0] if isinstance(logits, tuple) else logits)

    return NextLayerRouting(
        norm=rms_norm,
        route=route,
        route_logits=route_logits,
        fused=_fused_routing(gate, norm, runner.router),
    )


def _fused_routing(gate: VllmModule, norm: VllmModule, router: Any) -> FusedRouting | None:
    """The routing as tensors for the Triton predictor, when the device has Triton and the
    router is vLLM's plain softmax top-k (no groups, bias or custom function) on an
    unbiased gate."""
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import (
        FusedTopKRouter,
    )

    weight = getattr(gate, "weight", None)
    if (
        not current_platform.is_cuda()
        or type(router) is not FusedTopKRouter
        or router.scoring_func != "softmax"
        or weight is None
        or weight.dim() != 2
        or getattr(gate, "bias", None) is not None
    ):
        return None
    return FusedRouting(
        gate_weight=weight.data,
        norm_weight=norm.weight.data,
        eps=norm.variance_epsilon,
        top_k=router.top_k,
        renormalize=router.renormalize,
    )


def _offloaded_layers(model: VllmModule) -> list[tuple[int, VllmModule, OffloadedRoutedExperts]]:
    layers = model.model.layers
    found = []
    for index, layer in enumerate(layers):
        runner = getattr(getattr(layer, "mlp", None), "experts", None)
        routed = getattr(runner, "routed_experts", None)
        if isinstance(routed, OffloadedRoutedExperts):
            found.append((index, layer, routed))
    return found


def wire_model(model: VllmModule) -> None:
    """Connect consecutive offloaded MoE layers of a loaded model (see module doc)."""
    layers = _offloaded_layers(model)
    if not layers:
        return
    engine = layers[0][2].engine
    next_routing = {}
    for (_, _, routed), (_, next_layer, next_routed) in itertools.pairwise(layers):
        engine.link_layers(routed.layer_name, next_routed.layer_name)
        next_routing[routed.layer_name] = _routing_of(next_layer)
    engine.provide(next_routing=next_routing)
    if engine.config.quality is not None:
        from vllm_specexpert.layers.final_tap import install_final_tap

        install_final_tap(model, engine, layers[0][2].decode_query_len)
    if engine.config.calibration is None:
        _attach_mesh(engine, layers, None)
        engine.start()
        return
    from vllm_specexpert.calibration import load_calibration

    calibration = load_calibration(engine.config.calibration)  # checked at engine start
    if engine.config.estimator is not None and runner_is_eager():
        for _, layer, routed in layers[1:]:  # router_free can be switched on at run time
            RouterFreeHook(layer.mlp.experts, routed)
        engine.provide(skippable_routers=frozenset(r.layer_name for _, _, r in layers[1:]))
    engine.provide(
        predictor_inputs=_estimator_inputs(
            engine.config,
            layers,
            PredictorInputs(
                {
                    routed.layer_name: calibration.default_vectors[index]
                    for index, _, routed in layers
                },
                {
                    routed.layer_name: residual_scale(
                        layer.post_attention_layernorm.weight.data, calibration.residual_rms[index]
                    )
                    for index, layer, routed in layers
                },
            ),
        ).to(engine.device)
    )
    engine.provide(
        routing_statistics={
            routed.layer_name: (
                calibration.coactivation[index].numpy(),
                calibration.tae_percentiles[index].numpy(),
            )
            for index, _, routed in layers
        }
    )
    _attach_mesh(engine, layers, calibration)
    engine.start()


def _estimator_inputs(
    config: SpecExpertConfig, layers: list, inputs: PredictorInputs
) -> PredictorInputs:
    """``inputs`` with the estimator of ``config.estimator`` and the layers ``hybrid``
    runs it after (by ``config.analysis``), logged; all checked at engine start."""
    if config.estimator is None:
        return inputs
    from vllm_specexpert.predict.estimator_network import load_estimator, transitions_of
    from vllm_specexpert.predict.hybrid import (
        check_layers,
        hybrid_layers,
        read_analysis,
    )

    inputs.estimator = load_estimator(config.estimator)
    names = {index: routed.layer_name for index, _, routed in layers}
    inputs.estimator_layers = transitions_of(inputs.estimator, names)
    if config.analysis is not None:
        analysis = read_analysis(config.analysis)
        check_layers(analysis, sorted(names))
        chosen, threshold = hybrid_layers(analysis, config.hybrid_threshold)
        inputs.hybrid_layers = frozenset(names[i] for i in chosen if i in names)
        logger.info(
            "specexpert: hybrid runs the estimator after MoE layers %s (their "
            "quasi_hidden recall below %.3f in %s), quasi_hidden after the others",
            chosen,
            threshold,
            config.analysis,
        )
    return inputs


def _attach_mesh(engine: Any, layers: list, calibration: Any) -> None:
    """``mesh``: start the peers, each reading its shard of the checkpoint, and pin the
    hot experts of ``replicate_hot`` (by the calibration's routing counts)."""
    mesh = engine.config.mesh
    if mesh is None:
        return
    from vllm_specexpert.features.mesh import host_pairs
    from vllm_specexpert.peers.shard import ShardSpec, check_checkpoint
    from vllm_specexpert.peers.tier import PeerTier

    routed = layers[0][2]
    num_experts = routed.global_num_experts
    names = {index: (r.layer_name, tuple(range(num_experts))) for index, _, r in layers}
    check_checkpoint(routed.checkpoint, names)
    hot = {}
    if mesh.placement == "replicate_hot":  # (hot_count checked: SpecExpertConfig.check_fits)
        hot = {
            index: np.argsort(-calibration.counts[index].numpy(), kind="stable")[: mesh.hot_count]
            for index, _, _ in layers
        }
    kernel = routed.slot_kernel.direct_experts()
    activation = getattr(routed.activation, "value", str(routed.activation))
    spec = ShardSpec(
        routed.checkpoint,
        names,
        tuple(engine.store.layers[routed.layer_name].slot_shapes["w13_weight"][0]),
        kernel.isa if kernel is not None else None,
        activation,
    )
    by_index = {layer.index: layer for layer in engine.layers.values()}

    def reference(index: int, x: torch.Tensor, pairs: np.ndarray) -> torch.Tensor:
        return host_pairs(by_index[index].experts, by_index[index].host_kernel, x, pairs)

    engine.provide(
        peer_tier=PeerTier(mesh, spec, num_experts, reference, local=hot), hot_experts=hot
    )


def _offload_aware(base: type[nn.Module]) -> type[nn.Module]:
    class Model(base):  # type: ignore[valid-type,misc]  # (a class made per architecture)
        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            configured = SpecExpertConfig.from_additional_config(vllm_config.additional_config)
            if (
                configured is not None
                and configured.lookahead is not None
                and vllm_config.quant_config is not None
            ):
                # The lookahead draft is the target's checkpoint: its layers are
                # quantized as the checkpoint names them, without the draft's prefix.
                vllm_hooks.quantize_by_checkpoint_names(vllm_config.quant_config, DRAFT_PREFIX)
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            if configured is None:
                self.__class__ = base  # type: ignore[assignment]  # not configured: vLLM's

        def process_weights_after_loading(self) -> None:
            parent = getattr(super(), "process_weights_after_loading", None)
            if parent is not None:
                parent()
            wire_model(self)

    Model.__name__ = base.__name__
    Model.__qualname__ = base.__qualname__
    return Model


def __getattr__(name: str) -> type[nn.Module]:
    """``vllm_specexpert.layers.model_classes:<Architecture>`` for vLLM's lazy model registry."""
    if name not in SUPPORTED_ARCHITECTURES:
        raise AttributeError(name)
    module = importlib.import_module(SUPPORTED_ARCHITECTURES[name].vllm_module)
    _register_routed_experts_of(module)
    cls = _offload_aware(getattr(module, name))
    globals()[name] = cls
    return cls


def _register_routed_experts_of(module: Any) -> None:
    """vLLM instantiates pluggable layers by class name: a model module's own
    ``RoutedExperts`` subclass gets its offloaded variant registered under its name."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    for value in vars(module).values():
        if (
            isinstance(value, type)
            and issubclass(value, RoutedExperts)
            and value.__module__ == module.__name__
            and value.__name__ not in op_registry_oot
        ):
            RoutedExperts.register_oot(offloaded(value), name=value.__name__)


def register_models() -> None:
    from vllm import ModelRegistry

    for arch in SUPPORTED_ARCHITECTURES:
        ModelRegistry.register_model(arch, f"{__name__}:{arch}")
