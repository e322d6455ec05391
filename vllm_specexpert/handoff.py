"""What the scheduler process hands the workers each step: the decode tokens of the step
and the experts a path predictor expects them to use, and the scheduler's counters (what
the workers hand back is :mod:`vllm_specexpert.handback`).

The scheduler (:mod:`vllm_specexpert.schedule.token_scheduler`) attaches a
:class:`StepDemand` and its :class:`SchedulerStats` to vLLM's ``SchedulerOutput``
(:func:`attach`, :func:`attach_scheduler_stats`; pickled to the workers); in the
worker :func:`receive` (hooked by :func:`vllm_specexpert.vllm_hooks.keep_step_demand`)
keeps them for the step's layers (:func:`current`) and the worker's stats. Both sides
import only this module. Every step reaches the worker before any later RPC, so
``get_stats`` sees the scheduler's counters as of its last step, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_specexpert.stats import Counters, counter, highest, seconds

ATTRIBUTE = "specexpert_demand"
"""Name of the attribute on ``SchedulerOutput``."""
STATS_ATTRIBUTE = "specexpert_scheduler_stats"
"""Name of the scheduler's counters' attribute on ``SchedulerOutput``."""


@dataclass
class SchedulerStats(Counters):
    """Counters of the plugin's scheduler since the engine started (``reset_stats`` and
    ``reconfigure`` reach the workers only, so they do not restart them)."""

    steps: int = counter("Scheduling steps (vLLM's schedule() calls).")
    grouped_steps: int = counter(
        "Steps with more runnable decode sequences than token_scheduler.group_size (one group ran)."
    )
    ungrouped_steps: int = counter(
        "Steps with more runnable decode sequences than token_scheduler.group_size that "
        "ran them all: the governor measured grouping costing more time per decode token."
    )
    held: int = counter("Sequence-steps held back (a sequence held for 3 steps counts 3).")
    max_waited: int = highest("Longest run of consecutive steps any sequence was held back.")
    pairs_run: int = counter(
        "Predicted distinct (layer, expert) pairs of the groups that ran, summed over "
        "grouped steps."
    )
    pairs_all: int = counter(
        "Predicted distinct pairs had all runnable decode sequences run, same steps."
    )
    pairs_in_order: int = counter(
        "Predicted distinct pairs had the first group_size runnable sequences in "
        "vLLM's order run instead of the chosen group (a group of the same size, not "
        "chosen by route), same steps."
    )
    cpu_s: float = seconds(
        "Seconds the scheduler spent predicting and grouping (vLLM's own scheduling not included)."
    )
    max_step_cpu_s: float = highest("Longest of those per step, seconds.", 0.0)


@dataclass
class DemandCounters(Counters):
    """How well a step's demand covered one layer's decode calls (beside the engine's
    counters while the ``step_demand`` feature runs)."""

    path_needed: int = counter(
        "Distinct experts of decode calls that had a step-level prediction from "
        "the path predictor (``path_predictor``) or the lookahead draft, summed over calls."
    )
    path_covered: int = counter(
        "Of those, experts the step's prediction contained: ``path_covered / "
        "path_needed`` is the predictor's batch-level accuracy (ExpertFlow's "
        "B_acc) at the running batch size, measured online."
    )


@dataclass
class StepDemand:
    """The decode tokens of one step and their predicted experts."""

    tokens: int | None
    """Decode tokens the prediction covers (the step's decode requests); ``None``: the
    next pass's decode tokens, however many (a lookahead draft's verification pass)."""
    layers: dict[int, np.ndarray]
    """Decoder-layer index -> ``[E]`` predicted decode tokens per expert."""
    next_layers: dict[int, np.ndarray] | None = None
    """The same for the decode group expected to run next step (the token scheduler
    holds it back this step), ``None`` when the same requests are expected to run."""

    def scored(
        self, layer: int, router_ids: np.ndarray, counters: DemandCounters
    ) -> StepDemand | None:
        """This demand if it covers this decode call, scored against the experts chosen
        (into ``counters``); else ``None``."""
        if self.tokens not in (None, router_ids.shape[0]) or layer not in self.layers:
            return None  # not this pass's decode tokens
        used = np.unique(router_ids)
        counters.path_needed += len(used)
        counters.path_covered += int(np.count_nonzero(self.layers[layer][used]))
        return self


_current: StepDemand | None = None
_scheduler_stats: dict[str, Any] | None = None


def attach(scheduler_output: Any, demand: StepDemand) -> None:
    """Scheduler side: send ``demand`` with the step's ``SchedulerOutput``."""
    setattr(scheduler_output, ATTRIBUTE, demand)


def attach_scheduler_stats(scheduler_output: Any, stats: dict[str, Any]) -> None:
    """Scheduler side: send the scheduler's counters (a copy) with the step."""
    setattr(scheduler_output, STATS_ATTRIBUTE, stats)


def receive(scheduler_output: Any) -> None:
    """Worker side, as a step starts: keep its demand and the scheduler's counters."""
    global _current, _scheduler_stats
    _current = getattr(scheduler_output, ATTRIBUTE, None)
    _scheduler_stats = getattr(scheduler_output, STATS_ATTRIBUTE, None)


def forget_scheduler_stats() -> None:
    """A new scheduler starts: counters kept from an earlier engine of this process (an
    in-process engine runs its worker in the scheduler's process) are not its."""
    global _scheduler_stats
    _scheduler_stats = None


def scheduler_stats() -> dict[str, Any] | None:
    """Worker side: the scheduler's counters as of the latest step, if any."""
    return _scheduler_stats


def current() -> StepDemand | None:
    """The running step's demand (``None``: no prediction for it)."""
    return _current
