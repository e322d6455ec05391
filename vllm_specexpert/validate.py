"""Engine-config checks and the engine settings the offloaded layer needs, run where vLLM
builds the engine config (the calling process: ``LLM()``, ``vllm serve``, ``vllm bench``),
so that a bad setting fails once, clearly, before any engine process starts
(:func:`before_engine_config`, :func:`after_engine_config`). The same module checks the
``--plugins`` names and that a ``specexpert`` config will reach the plugin."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vllm_specexpert import metrics
from vllm_specexpert.config import (
    ADDITIONAL_CONFIG_KEY,
    SpecExpertConfig,
    SpecExpertConfigError,
    SpecExpertUnsupportedError,
)
from vllm_specexpert.config.sections import LookaheadConfig, MeshConfig
from vllm_specexpert.log import init_logger
from vllm_specexpert.worker import WORKER_EXTENSION

if TYPE_CHECKING:
    from vllm_specexpert.architectures import MoEShape

logger = init_logger(__name__)

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "specexpert"
"""This plugin's entry point name in :data:`PLUGIN_GROUP`."""


def before_engine_config(engine_args: Any) -> SpecExpertConfig | None:
    """Before vLLM builds the engine config: the plugin's config (``None``: not
    configured, nothing to do), checked, and the engine settings it needs."""
    config = SpecExpertConfig.from_additional_config(engine_args.additional_config)
    if config is not None:
        check_plugin_enabled()
        if config.mesh is not None:
            from vllm_specexpert.peers.ray_cluster import require_ray

            require_ray()  # the mesh extra, before any engine process starts
        prepare_engine_args(engine_args, config)
    return config


def after_engine_config(engine_args: Any, vllm_config: Any, config: SpecExpertConfig) -> None:
    """Once the engine config is built: the model-dependent checks, the CPU build's KV
    cache size where none is given, then (only for a start they let through, of an
    engine a server serves) the metrics directory the engine processes will write to."""
    validate_engine_config(vllm_config, config)
    from vllm_specexpert.layers.sizing import size_cpu_kv_cache

    size_cpu_kv_cache(
        vllm_config,
        batch_from_experts=config.disk is not None
        and config.budget == "auto"
        and _packed_experts(vllm_config.model_config) is None,
    )
    if serves_metrics(engine_args):
        names = getattr(engine_args, "served_model_name", None) or engine_args.model
        metrics.prepare_frontend(names[0] if isinstance(names, list) else str(names))


def serves_metrics(engine_args: Any) -> bool:
    """Whether the process building this engine serves ``/metrics``: vLLM's API server
    builds its engine from ``AsyncEngineArgs``; ``LLM()`` from ``EngineArgs``, and no
    one would read its snapshots."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return isinstance(engine_args, AsyncEngineArgs)


def installed_plugins() -> list[str]:
    """Names of the installed ``vllm.general_plugins`` entry points."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group=PLUGIN_GROUP)})


def plugin_names(values: list[str]) -> list[str]:
    """The names of ``--plugins a,b`` (or ``a b``), each an installed general plugin;
    ``ValueError`` naming the unknown ones and the installed ones otherwise."""
    names = [n for value in values for n in value.split(",") if n]
    installed = installed_plugins()
    unknown = [n for n in names if n not in installed]
    if not names or unknown:
        raise ValueError(
            f"unknown plugin {', '.join(unknown) or '(none)'}; installed vLLM "
            f"general plugins: {', '.join(installed) or 'none'}"
        )
    return names


def check_plugin_enabled(where: str = "the engine processes") -> None:
    """``additional_config`` configures the plugin, but ``VLLM_PLUGINS`` (or
    ``--plugins``) keeps it out of ``where``: its config would be ignored there and
    vLLM would serve without offloading."""
    names = os.environ.get("VLLM_PLUGINS")
    if names is not None and PLUGIN_NAME not in names.split(","):
        raise SpecExpertConfigError(
            ADDITIONAL_CONFIG_KEY,
            f"additional_config configures the plugin, but "
            f"VLLM_PLUGINS={names!r} leaves it out of {where}",
            f"add {PLUGIN_NAME} to --plugins (or to VLLM_PLUGINS, or unset VLLM_PLUGINS), "
            f"or remove the {ADDITIONAL_CONFIG_KEY} key",
        )


def prepare_engine_args(engine_args: Any, config: SpecExpertConfig | None = None) -> None:
    """Engine settings the offloaded layer needs, applied before the config is built."""
    from vllm.platforms import current_platform

    if config is not None and (config.path_predictor is not None or config.disk is not None):
        _install_scheduler(engine_args, config)
    if config is not None and config.lookahead is not None:
        _configure_draft(engine_args, config.lookahead)
    if current_platform.is_cuda_alike():
        _pin_triton_moe_backend(engine_args)
        if config is not None and config.disk is not None:
            _schedule_in_step(engine_args)
    if engine_args.worker_extension_cls in ("", None):
        engine_args.worker_extension_cls = WORKER_EXTENSION
    elif engine_args.worker_extension_cls != WORKER_EXTENSION:
        logger.warning(
            "specexpert: worker_extension_cls=%s is set, so the "
            "specexpert_stats RPC is unavailable (stats_path still works)",
            engine_args.worker_extension_cls,
        )


def _schedule_in_step(engine_args: Any) -> None:
    """The disk tier on CUDA: the requests whose experts could not be read are handed to
    the scheduler on the step's output; vLLM's async scheduling would schedule the next
    step before it arrives, so it is turned off (asked for: refused)."""
    if getattr(engine_args, "async_scheduling", None):
        raise SpecExpertConfigError(
            "disk",
            "hands the requests whose experts could not be read to the scheduler on the "
            "step's output, and --async-scheduling schedules the next step before it",
            "remove --async-scheduling, or remove disk",
        )
    engine_args.async_scheduling = False


def _install_scheduler(engine_args: Any, config: SpecExpertConfig) -> None:
    """vLLM's scheduler class is replaced by the plugin's subclass: with the disk tier,
    one that fails the requests whose experts could not be read
    (:mod:`vllm_specexpert.schedule.scheduler`); with a ``path_predictor``, its subclass
    that also predicts each step's experts (and groups decode sequences under
    ``token_scheduler``). It runs in the engine-core process, where general plugins are
    loaded first."""
    from vllm_specexpert.schedule import scheduler, token_scheduler

    wanted = (
        token_scheduler.SCHEDULER_CLS
        if config.path_predictor is not None
        else scheduler.SCHEDULER_CLS
    )
    field = "path_predictor" if config.path_predictor is not None else "disk"
    current = getattr(engine_args, "scheduler_cls", None)
    if current not in (None, wanted):
        raise SpecExpertConfigError(
            field,
            f"runs in the plugin's scheduler class, and scheduler_cls={current!r} is set",
            f"remove --scheduler-cls, or remove {field}",
        )
    engine_args.scheduler_cls = wanted


def _configure_draft(engine_args: Any, lookahead: LookaheadConfig) -> None:
    """``lookahead`` runs through vLLM's speculative decoding with a ``draft_model`` on
    the same checkpoint, ``k_max`` tokens: set it, or check the user's. vLLM's async
    scheduling is turned off: the governor sets each step's draft length in the worker,
    after the step's verification."""
    k_max = lookahead.k_max
    wanted = {"method": "draft_model", "model": engine_args.model, "num_speculative_tokens": k_max}
    given = engine_args.speculative_config
    if given is None:
        engine_args.speculative_config = wanted
    else:
        if not isinstance(given, dict):
            given = {name: getattr(given, name, None) for name in wanted}
        method = given.get("method") or ("draft_model" if given.get("model") else None)
        conflicts = [
            f"{name}={given.get(name)!r}"
            for name, value in wanted.items()
            if name in given and given.get(name) is not None and given.get(name) != value
        ]
        if method != "draft_model" or conflicts:
            raise SpecExpertConfigError(
                "lookahead",
                "drafts with vLLM's speculative decoding (method "
                f"'draft_model', the same model, num_speculative_tokens = k_max = {k_max}),"
                f" and speculative_config sets {', '.join(conflicts) or repr(method)}",
                "remove speculative_config (the plugin sets it), or remove lookahead",
            )
    if getattr(engine_args, "async_scheduling", None):
        raise SpecExpertConfigError(
            "lookahead",
            "sets each step's draft length in the worker after the step's "
            "verification, and async_scheduling is on",
            "remove --async-scheduling, or remove lookahead",
        )
    engine_args.async_scheduling = False


def _pin_triton_moe_backend(engine_args: Any) -> None:
    """The offloaded layer runs vLLM's Triton fused-MoE kernel on its slot pool. vLLM's
    backend oracle would otherwise pick FlashInfer's kernels on some GPUs (monolithic
    ones take the router logits and every expert's weights, not a slot pool)."""
    backend = getattr(engine_args, "moe_backend", "auto")
    if backend == "auto":
        engine_args.moe_backend = "triton"
    elif backend != "triton":
        raise SpecExpertUnsupportedError(
            f"moe_backend={backend!r}",
            "offloaded experts run on vLLM's Triton fused-MoE kernel, from the slot pool",
            "leave --moe-backend unset (auto) or set 'triton'",
        )


def keep_piecewise_cuda_graphs(compilation_config: Any) -> None:
    """Which experts to copy is decided on the host from the router's output, so the
    offloaded op must never be captured in a CUDA graph (a replay would repeat one
    step's copies forever). It becomes a splitting op: piecewise graphs keep
    everything else (attention, norms, routers) captured, and the op runs eagerly
    between them. Full graphs would capture it: they are turned down to piecewise
    (with compilation) or off (without), with a warning."""
    from vllm.config import CompilationMode, CUDAGraphMode

    from vllm_specexpert.layers.final_tap import FINAL_HIDDEN_OP
    from vllm_specexpert.layers.routed_experts import ROUTED_EXPERTS_OP

    mode = compilation_config.cudagraph_mode
    if mode is None or mode == CUDAGraphMode.NONE:
        return
    if compilation_config.mode != CompilationMode.VLLM_COMPILE:
        logger.warning(
            "specexpert: cudagraph_mode %s -> NONE: without piecewise "
            "compilation a graph would capture the offloaded experts' "
            "data-dependent copies",
            mode.name,
        )
        compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        return
    if compilation_config.splitting_ops is None:
        compilation_config.splitting_ops = []
    for op in (ROUTED_EXPERTS_OP, FINAL_HIDDEN_OP):  # the tap's: quality's Python per pass
        if op not in compilation_config.splitting_ops:
            compilation_config.splitting_ops.append(op)
    if mode.has_full_cudagraphs():
        logger.warning(
            "specexpert: cudagraph_mode %s -> PIECEWISE: a full graph would "
            "capture the offloaded experts' data-dependent copies",
            mode.name,
        )
        compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE


def validate_engine_config(vllm_config: Any, config: SpecExpertConfig) -> None:
    """Model-dependent checks, in the process that builds the engine config, and the
    CUDA-graph settings the offloaded op needs."""
    from vllm.platforms import current_platform

    from vllm_specexpert.architectures import check_supported, moe_shape
    from vllm_specexpert.layers.router_free import runner_is_eager

    if not current_platform.is_cpu():
        keep_piecewise_cuda_graphs(vllm_config.compilation_config)
    check_supported(vllm_config)
    model_config = vllm_config.model_config
    shape = moe_shape(model_config.hf_config)
    packed = _packed_experts(model_config)
    config.check_fits(shape.num_experts, shape.top_k, packed)
    if isinstance(config.budget, str) and config.budget != "auto" and packed is None:
        _check_size_budget(config.budget, shape, model_config)
    if config.router_free and not runner_is_eager(vllm_config):
        raise SpecExpertConfigError(
            "router_free",
            "skips routers in Python per call, and this engine's MoE "
            "runner is traced into torch.compile's graph (the CPU build's compiled mode)",
            "start the engine with enforce_eager=True (--enforce-eager), or remove it",
        )
    if config.mesh is not None:
        _check_mesh(config.mesh, model_config)
    if config.disk is not None:
        _check_disk(config, model_config)
    if config.stats_path is not None:
        from vllm_specexpert.stats import check_stats_path

        check_stats_path(config.stats_path.replace("{rank}", "0"))
    layers = getattr(model_config.hf_config, "num_hidden_layers", None)
    if config.exact_layers and layers is not None and max(config.exact_layers) >= layers:
        raise SpecExpertConfigError(
            "exact_layers",
            f"layer {max(config.exact_layers)} does not exist: the model has "
            f"{layers} decoder layers",
            f"give indices of its MoE layers, below {layers}",
        )
    if config.calibration is not None:
        from vllm_specexpert.calibration import load_calibration

        load_calibration(
            config.calibration,
            model=model_config.model,
            hf_config=model_config.hf_config,
            num_experts=shape.num_experts,
        )
    if config.estimator is not None or config.analysis is not None:
        _check_estimator(config, model_config)
    if config.lookahead is not None:
        _check_draft(config, shape)
    if config.path_predictor is not None:
        from vllm_specexpert.predict.path import load_path_predictor

        load_path_predictor(
            config.path_predictor, model=model_config.model, hf_config=model_config.hf_config
        )


def _check_size_budget(budget: str, shape: MoEShape, model_config: Any) -> None:
    """A size budget that does not buy ``top_k`` slots per layer, refused here rather
    than in the worker: the experts' bytes in the checkpoint's form are a lower bound
    of a slot's, so what is refused here would be refused there too."""
    from vllm_specexpert.architectures import expert_nbytes, moe_layer_count
    from vllm_specexpert.config.sizing import ModelShapes, fit_budget

    hf_config = model_config.hf_config
    shapes = ModelShapes(
        moe_layers=moe_layer_count(hf_config),
        num_experts=shape.num_experts,
        top_k=shape.top_k,
        expert_bytes=expert_nbytes(hf_config, model_config.dtype.itemsize),
        moe_intermediate_size=0,
        kv_bytes_per_token=0,
        max_num_seqs=0,
        max_model_len=0,
        max_num_batched_tokens=0,
    )
    fit_budget(budget, shapes, memory=None)


def _packed_experts(model_config: Any) -> str | None:
    """The format the checkpoint's routed experts are packed in (``None``: bf16/fp16)."""
    from vllm_specexpert.quant_config import format_of

    checkpoint = getattr(model_config.hf_config, "quantization_config", None)
    if model_config.quantization is None or not checkpoint:
        return None
    fmt = format_of(dict(checkpoint))
    return fmt.name if fmt is not None else None


def _check_mesh(mesh: MeshConfig, model_config: Any) -> None:
    """A cluster that answers at ``mesh.ray_address`` (bounded: Ray itself retries for
    a minute), and a checkpoint whose experts a peer can read."""
    from vllm_specexpert.peers.ray_cluster import check_reachable
    from vllm_specexpert.peers.shard import check_checkpoint_layout

    check_reachable(mesh.ray_address)
    check_checkpoint_layout(model_config.model)


def _check_disk(config: SpecExpertConfig, model_config: Any) -> None:
    """The disk tier on the CPU or CUDA build (``host_cache`` on CUDA only), and its
    pack: made now when absent (before any worker starts), else checked against the
    checkpoint (a quantized checkpoint is refused by ``check_fits``)."""
    from vllm.platforms import current_platform

    from vllm_specexpert.layers.int4_copies import Int4DraftForm
    from vllm_specexpert.tiers.kernel_form import model_kernel_form
    from vllm_specexpert.tiers.pack_writer import prepare_pack

    assert config.disk is not None
    if current_platform.is_cpu() and config.disk.host_cache is not None:
        raise SpecExpertConfigError(
            "disk.host_cache",
            "is the pinned host memory between the disk and a GPU; on the CPU build the "
            "slots are in host memory, the only tier above the disk",
            "remove disk.host_cache and size the slots with budget",
        )
    if not (current_platform.is_cpu() or current_platform.is_cuda()):
        raise SpecExpertConfigError(
            "disk",
            "the disk tier is built for the CPU and CUDA builds, not "
            f"{current_platform.device_name}",
            "remove disk",
        )
    form = model_kernel_form(model_config.dtype, current_platform.is_cpu())
    draft = Int4DraftForm(model_config.dtype) if config.lookahead is not None else None
    prepare_pack(str(config.disk.path), model_config.model, form, draft)


def _check_estimator(config: SpecExpertConfig, model_config: Any) -> None:
    """The estimator (and ``hybrid``'s analysis) made for this model and calibration
    (their MoE layers are checked when the model is wired). An analysis without an
    estimator is refused: it only chooses where ``hybrid`` runs the estimator, and the
    estimator cannot be added at run time, so it could never be used."""
    from vllm_specexpert.predict.estimator_network import load_estimator
    from vllm_specexpert.predict.hybrid import read_analysis

    if config.estimator is None:
        raise SpecExpertConfigError(
            "analysis",
            "only chooses the layers after which predictor 'hybrid' runs the "
            "estimator, and no estimator is set (one cannot be added at run time)",
            'also set "estimator" (from `specexpert train-estimator MODEL --out DIR`), '
            "or remove analysis",
        )
    load_estimator(
        config.estimator,
        model=model_config.model,
        hf_config=model_config.hf_config,
        calibration=config.calibration,
    )
    if config.analysis is not None:
        read_analysis(config.analysis, model=model_config.model, hf_config=model_config.hf_config)


def _check_draft(config: SpecExpertConfig, shape: MoEShape) -> None:
    """``lookahead``'s draft: its slots must hold one token's experts (its INT4
    experts need a bf16/fp16 checkpoint: :meth:`SpecExpertConfig.check_fits`)."""
    try:
        config.draft_config(shape.top_k).slots_per_layer(shape.num_experts, shape.top_k)
    except SpecExpertConfigError as error:
        raise SpecExpertConfigError(
            "lookahead.draft_budget", error.problem, error.fix.replace("budget", "draft_budget")
        ) from None
