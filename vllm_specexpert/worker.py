"""Worker extension: the RPCs that read the engine's statistics.

The plugin sets it as vLLM's ``worker_extension_cls`` when ``specexpert`` is configured,
so ``llm.collective_rpc("specexpert_stats")`` works (see :func:`vllm_specexpert.get_stats`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_specexpert.config import SpecExpertConfigError

if TYPE_CHECKING:
    from vllm_specexpert.engine import OffloadEngine

WORKER_EXTENSION = "vllm_specexpert.worker.SpecExpertWorkerExtension"
"""This class, as vLLM's ``worker_extension_cls`` (set by the plugin)."""
CONFIG_ERROR = "specexpert_config_error"
"""Key of a rejected ``reconfigure``'s reply: ``[field, problem, fix]``."""


class SpecExpertWorkerExtension:
    model_runner: Any  # the vLLM worker's, whose class this one extends (annotation only)

    def _specexpert_engine(self) -> OffloadEngine:
        from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts

        for module in self.model_runner.get_model().modules():
            if isinstance(module, OffloadedRoutedExperts):
                return module.engine
        raise RuntimeError("specexpert: this worker's model has no offloaded MoE layer")

    def specexpert_stats(self) -> dict[str, Any]:
        """Per-layer statistics of this worker (also written to ``stats_path``)."""
        engine = self._specexpert_engine()
        engine.write_stats()
        return engine.stats()

    def specexpert_reconfigure(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Apply config ``changes`` (e.g. ``{"budget": 0.25}``) to the running engine:
        caches are rebuilt at the new budget without reloading the model. Returns the
        new config, as given (what its budget came to is in the stats' ``budget``)."""

        engine = self._specexpert_engine()
        try:
            config = engine.config.changed(changes)
            engine.reconfigure(config)
        except SpecExpertConfigError as error:
            # Returned, not raised: a raise here would be logged with its traceback by
            # the worker and again by the engine core, for a user's typo.
            return {CONFIG_ERROR: [error.field_name, error.problem, error.fix]}
        return engine.config.to_dict()

    def specexpert_restart(self) -> None:
        """Caches back to their warm start and counters to zero (after vLLM's warm-up,
        see ``OffloadEngine.restart``); on the CPU build, the warm-up's freed scratch
        given back to the OS."""
        from vllm_specexpert.tiers.memory import release_free_heap

        engine = self._specexpert_engine()
        engine.restart()
        if engine.device.type == "cpu":
            release_free_heap()

    def specexpert_reset_stats(self) -> None:
        """Zero every counter (e.g. after warm-up, before a measurement)."""
        self._specexpert_engine().reset_stats()
