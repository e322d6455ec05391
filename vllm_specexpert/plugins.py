"""vLLM entry point. ``register`` is the ``vllm.general_plugins`` entry ``specexpert``.

vLLM calls it in every process (API server, engine core, workers), before any engine
config exists. It installs these, all inert unless ``additional_config`` has a
``specexpert`` key (every patch of vLLM's code is in :mod:`vllm_specexpert.vllm_hooks`):

* the out-of-tree ``RoutedExperts`` class (:class:`OffloadedRoutedExperts`), which
  turns itself back into vLLM's own class when the key is absent;
* subclasses of vLLM's supported MoE model classes under their own architecture names
  (:mod:`vllm_specexpert.layers.model_classes`), which wire the offloaded layers for
  prediction after loading and likewise turn back into vLLM's classes when the key is
  absent;
* the engine-config checks of :mod:`vllm_specexpert.validate` around
  ``EngineArgs.create_engine_config``, so a bad setting fails at once with one clear
  error in the calling process instead of inside a worker;
* a ``--plugins NAME[,NAME...]`` flag on vLLM's engine arguments (``vllm serve``,
  ``vllm bench``): vLLM 0.32 only has ``VLLM_PLUGINS``. Parsing it checks the names
  against the installed ``vllm.general_plugins`` and sets ``VLLM_PLUGINS`` for the engine
  processes (started after parsing, they inherit it);
* a restart of the offloaded layers' caches after vLLM's warm-up: its passes run on
  uninitialized memory, and serving starts from the warm start instead of what they
  loaded (``OffloadEngine.restart``);
* the ``specexpert_*`` series in the registries vLLM builds for ``/metrics`` with
  several API servers (:func:`vllm_specexpert.metrics.environment_collector`).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from vllm_specexpert import metrics, validate, vllm_hooks
from vllm_specexpert.config import SpecExpertConfig


def register() -> None:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    if "RoutedExperts" not in op_registry_oot:
        from vllm_specexpert.layers.model_classes import register_models
        from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts

        RoutedExperts.register_oot(OffloadedRoutedExperts, name="RoutedExperts")
        register_models()
    vllm_hooks.around_engine_config(validate.before_engine_config, validate.after_engine_config)
    vllm_hooks.after_warm_up(restart_caches)
    vllm_hooks.add_engine_arguments(add_plugins_argument)
    vllm_hooks.add_to_multiprocess_registries(metrics.environment_collector)


def restart_caches(executor: Any) -> None:
    """After vLLM's warm-up: every worker's caches back to their warm start."""
    if SpecExpertConfig.from_additional_config(executor.vllm_config.additional_config) is not None:
        executor.collective_rpc("specexpert_restart")


class PluginsAction(argparse.Action):
    """``--plugins a,b`` (or ``--plugins a b``): check the names, set ``VLLM_PLUGINS``."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,  # a list of str (nargs="+")
        option_string: str | None = None,
    ) -> None:
        try:
            names = validate.plugin_names(values)
        except ValueError as error:
            parser.error(f"{option_string}: {error}")
        os.environ["VLLM_PLUGINS"] = ",".join(names)
        setattr(namespace, self.dest, names)


def add_plugins_argument(parser: argparse.ArgumentParser) -> None:
    if "--plugins" not in parser._option_string_actions:
        parser.add_argument(
            "--plugins",
            nargs="+",
            action=PluginsAction,
            metavar="NAME",
            help="vLLM general plugins to load in the engine processes (sets "
            "VLLM_PLUGINS), e.g. --plugins specexpert. Added by the specexpert "
            "plugin; installed: " + ", ".join(validate.installed_plugins()),
        )
