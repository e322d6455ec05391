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


def get_stats(llm: Any) -> list[dict[str, Any]]:
    """Per-worker statistics of an ``LLM`` running with the plugin (one dict per worker)."""
    return llm.collective_rpc("specexpert_stats")


def reconfigure(llm: Any, **changes: Any) -> dict[str, Any]:
    """Change the running engine's config, e.g. ``reconfigure(llm, budget=0.25)``.
    Caches are rebuilt without reloading weights; counters restart. Returns the config;
    a bad change raises :class:`SpecExpertConfigError` and leaves the engine as it was."""
    from vllm_specexpert.worker import CONFIG_ERROR

    reply = llm.collective_rpc("specexpert_reconfigure", args=(changes,))[0]
    if CONFIG_ERROR in reply:
        raise SpecExpertConfigError(*reply[CONFIG_ERROR])
    return reply


def reset_stats(llm: Any) -> None:
    """Zero the counters of every worker."""
    llm.collective_rpc("specexpert_reset_stats")


__all__ = [
    "LinkConfig",
    "SpecExpertConfig",
    "SpecExpertConfigError",
    "SpecExpertUnsupportedError",
    "get_stats",
    "reconfigure",
    "reset_stats",
]
