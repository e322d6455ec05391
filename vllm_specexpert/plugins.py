"""vLLM entry points. ``register`` is the ``vllm.general_plugins`` entry ``specexpert``.

vLLM calls it in every process (API server, engine core, workers), before any engine
config exists. It installs two things, both inert unless ``additional_config`` has a
``specexpert`` key:

* the out-of-tree ``RoutedExperts`` class (:class:`OffloadedRoutedExperts`), which
  turns itself back into vLLM's own class when the key is absent;
* subclasses of vLLM's supported MoE model classes under their own architecture names
  (:mod:`vllm_specexpert.layers.model_classes`), which wire the offloaded layers for prediction
  after loading and likewise turn back into vLLM's classes when the key is absent;
* a check around ``EngineArgs.create_engine_config`` that validates the config against
  the model in the calling process, so a bad setting fails at once with one clear error
  instead of inside a worker, and that enables the stats RPCs (worker extension).
"""

from __future__ import annotations

import functools

from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.log import init_logger

logger = init_logger(__name__)

WORKER_EXTENSION = "vllm_specexpert.worker.SpecExpertWorkerExtension"


def register() -> None:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    if "RoutedExperts" not in op_registry_oot:
        from vllm_specexpert.layers.model_classes import register_models
        from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts

        RoutedExperts.register_oot(OffloadedRoutedExperts, name="RoutedExperts")
        register_models()
    _wrap_create_engine_config()


def _wrap_create_engine_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "_specexpert_checked", False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        config = SpecExpertConfig.from_additional_config(self.additional_config)
        if config is not None:
            prepare_engine_args(self, config)
        vllm_config = original(self, *args, **kwargs)
        if config is not None:
            validate_engine_config(vllm_config, config)
        return vllm_config

    create_engine_config._specexpert_checked = True
    EngineArgs.create_engine_config = create_engine_config


def prepare_engine_args(engine_args, config: SpecExpertConfig | None = None) -> None:
    """Engine settings the offloaded layer needs, applied before the config is built."""
    from vllm.platforms import current_platform

    if config is not None and config.path_predictor is not None:
        _install_scheduler(engine_args)
    if current_platform.is_cuda_alike():
        _pin_triton_moe_backend(engine_args)
    if engine_args.worker_extension_cls in ("", None):
        engine_args.worker_extension_cls = WORKER_EXTENSION
    elif engine_args.worker_extension_cls != WORKER_EXTENSION:
        logger.warning("specexpert: worker_extension_cls=%s is set, so the "
                       "specexpert_stats RPC is unavailable (stats_path still works)",
                       engine_args.worker_extension_cls)


def _install_scheduler(engine_args) -> None:
    """With a ``path_predictor``, vLLM's scheduler class is replaced by the plugin's
    subclass, which predicts each step's experts (and groups decode sequences under
    ``token_scheduler``). It runs in the engine-core process, where general plugins are
    loaded first."""
    from vllm_specexpert.config import SpecExpertConfigError
    from vllm_specexpert.schedule.token_scheduler import SCHEDULER_CLS

    current = getattr(engine_args, "scheduler_cls", None)
    if current not in (None, SCHEDULER_CLS):
        raise SpecExpertConfigError(
            "path_predictor", f"runs in the plugin's scheduler class, and scheduler_cls="
            f"{current!r} is set", "remove --scheduler-cls, or remove path_predictor")
    engine_args.scheduler_cls = SCHEDULER_CLS


def _pin_triton_moe_backend(engine_args) -> None:
    """The offloaded layer runs vLLM's Triton fused-MoE kernel on its slot pool. vLLM's
    backend oracle would otherwise pick FlashInfer's kernels on some GPUs (monolithic
    ones take the router logits and every expert's weights, not a slot pool)."""
    from vllm_specexpert.config import SpecExpertUnsupportedError

    backend = getattr(engine_args, "moe_backend", "auto")
    if backend == "auto":
        engine_args.moe_backend = "triton"
    elif backend != "triton":
        raise SpecExpertUnsupportedError(
            f"moe_backend={backend!r}", "offloaded experts run on vLLM's Triton fused-MoE "
            "kernel, from the slot pool", "leave --moe-backend unset (auto) or set 'triton'")


def keep_piecewise_cuda_graphs(compilation_config) -> None:
    """Which experts to copy is decided on the host from the router's output, so the
    offloaded op must never be captured in a CUDA graph (a replay would repeat one
    step's copies forever). It becomes a splitting op: piecewise graphs keep
    everything else (attention, norms, routers) captured, and the op runs eagerly
    between them. Full graphs would capture it: they are turned down to piecewise
    (with compilation) or off (without), with a warning."""
    from vllm.config import CompilationMode, CUDAGraphMode

    from vllm_specexpert.layers.routed_experts import ROUTED_EXPERTS_OP

    mode = compilation_config.cudagraph_mode
    if mode is None or mode == CUDAGraphMode.NONE:
        return
    if compilation_config.mode != CompilationMode.VLLM_COMPILE:
        logger.warning("specexpert: cudagraph_mode %s -> NONE: without piecewise "
                       "compilation a graph would capture the offloaded experts' "
                       "data-dependent copies", mode.name)
        compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        return
    if compilation_config.splitting_ops is None:
        compilation_config.splitting_ops = []
    if ROUTED_EXPERTS_OP not in compilation_config.splitting_ops:
        compilation_config.splitting_ops.append(ROUTED_EXPERTS_OP)
    if mode.has_full_cudagraphs():
        logger.warning("specexpert: cudagraph_mode %s -> PIECEWISE: a full graph would "
                       "capture the offloaded experts' data-dependent copies", mode.name)
        compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE


def validate_engine_config(vllm_config, config: SpecExpertConfig) -> None:
    """Model-dependent checks, in the process that builds the engine config, and the
    CUDA-graph settings the offloaded op needs."""
    from vllm.platforms import current_platform

    from vllm_specexpert.architectures import check_supported, moe_shape

    if not current_platform.is_cpu():
        keep_piecewise_cuda_graphs(vllm_config.compilation_config)
    check_supported(vllm_config)
    model_config = vllm_config.model_config
    shape = moe_shape(model_config.hf_config)
    config.slots_per_layer(shape.num_experts, shape.top_k)
    if config.calibration is not None:
        from vllm_specexpert.calibration import load_calibration

        load_calibration(config.calibration, model=model_config.model,
                         hf_config=model_config.hf_config)
    if config.path_predictor is not None:
        from vllm_specexpert.predict.path import load_path_predictor

        load_path_predictor(config.path_predictor, model=model_config.model,
                            hf_config=model_config.hf_config)
