"""vllm-specexpert: MoE inference with experts in a slow tier and a device expert cache.

Enable with ``VLLM_PLUGINS=specexpert`` (or no VLLM_PLUGINS at all) and
``additional_config={"specexpert": {...}}``; see :class:`SpecExpertConfig`.

How the parts relate (one worker; arrows read "uses")::

    vLLM ──► plugins.register ──► layers.routed_experts.OffloadedRoutedExperts (replaces
      │       (+ engine-config      │   vLLM's RoutedExperts; one custom op per MoE layer)
      │        check, worker.py     │──► layers.forward_phase ──► phases.PassPhases
      │        RPCs)                │      (which tokens of the pass decode, from vLLM)
      │                             ▼
      │      layers.model_classes ──► engine.OffloadEngine  (one per worker, no vLLM inside)
      │      (wires layer l to l+1,    ├─► store.ExpertStore          slow tier: every expert
      │       loads calibration.py)    ├─► transfer.Link              copy engine (CPU / CUDA)
      │                                ├─► per MoE layer:
      │                                │     cache.ExpertCache        slots, id<->slot, eviction
      │                                │     loader.ExpertLoader      copies in flight ──► Link
      │                                │     stats.LayerStats         counters per phase
      │                                ├─► predict.*                  next layer's experts
      │                                ├─► policy.MissPolicy          decides about misses
      │                                │     policy.executor           carries any plan out
      │                                │     host.HostExperts          experts on the host
      │                                ├─► staging.HostReader         one read per layer call
      │                                └─► stats.StatsWriter          stats_path, off the op
      ├─► schedule.token_scheduler.TokenGroupScheduler  (engine-core process; replaces
      │     vLLM's scheduler when token_scheduler is set) ──► predict.path (routes of
      │     every running sequence) ──► schedule.grouping.partition (one group per step)
      └── config.SpecExpertConfig: every knob, validated at engine start

    tools/ (training, corpus, fixtures, harness, offline passes, demo) and benchmarks/
    use the above; nothing above imports them.
"""

from __future__ import annotations

from typing import Any

from vllm_specexpert.config import (
    LinkConfig,
    SpecExpertConfig,
    SpecExpertConfigError,
    SpecExpertUnsupportedError,
)

__version__ = "0.1.0"


def _rpc(llm: Any, method: str, *args: Any) -> list[Any]:
    """``llm.collective_rpc`` of one of the plugin's worker methods, after checking that
    the plugin runs in this ``LLM`` (else one error saying why it does not)."""
    import os

    from vllm_specexpert.config import ADDITIONAL_CONFIG_KEY
    from vllm_specexpert.worker import WORKER_EXTENSION

    vllm_config = llm.llm_engine.vllm_config
    if ADDITIONAL_CONFIG_KEY not in (vllm_config.additional_config or {}):
        raise RuntimeError("specexpert: this LLM runs without the plugin: its "
                           "additional_config has no 'specexpert' key")
    extension = vllm_config.parallel_config.worker_extension_cls
    if extension != WORKER_EXTENSION:
        plugins = os.environ.get("VLLM_PLUGINS")
        if plugins is not None and "specexpert" not in plugins.split(","):
            raise RuntimeError(
                "specexpert: this LLM runs without the plugin although additional_config "
                f"configures it: VLLM_PLUGINS={plugins!r} kept it from loading; add "
                "specexpert to VLLM_PLUGINS, or unset it")
        raise RuntimeError(f"specexpert: worker_extension_cls={extension!r} replaces the "
                           "plugin's, so its RPCs are unavailable (stats_path still works)")
    return llm.collective_rpc(method, args=args)


def get_stats(llm: Any) -> list[dict[str, Any]]:
    """Per-worker statistics of an ``LLM`` running with the plugin (one dict per worker)."""
    return _rpc(llm, "specexpert_stats")


def reconfigure(llm: Any, **changes: Any) -> dict[str, Any]:
    """Change the running engine's config, e.g. ``reconfigure(llm, budget=0.25)``.
    Caches are rebuilt without reloading weights; counters restart. Settings kept from
    before that have no effect under the new mode return to their defaults. Returns the
    config; a bad change raises :class:`SpecExpertConfigError` and leaves the engine as
    it was."""
    from vllm_specexpert.worker import CONFIG_ERROR

    reply = _rpc(llm, "specexpert_reconfigure", changes)[0]
    if CONFIG_ERROR in reply:
        raise SpecExpertConfigError(*reply[CONFIG_ERROR])
    return reply


def reset_stats(llm: Any) -> None:
    """Zero the counters of every worker."""
    _rpc(llm, "specexpert_reset_stats")


__all__ = [
    "LinkConfig",
    "SpecExpertConfig",
    "SpecExpertConfigError",
    "SpecExpertUnsupportedError",
    "get_stats",
    "reconfigure",
    "reset_stats",
]
