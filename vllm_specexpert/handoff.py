"""What the scheduler process hands the workers each step: the decode tokens of the step
and the experts a path predictor expects them to use.

With a ``path_predictor``, the plugin's scheduler (engine-core process,
:mod:`vllm_specexpert.schedule.token_scheduler`) attaches a :class:`StepDemand` to vLLM's
``SchedulerOutput`` (a plain dataclass, pickled to the workers with its attributes) with
:func:`attach`; in the worker, vLLM's model runner is wrapped
(:func:`vllm_specexpert.vllm_hooks.keep_step_demand`) so that :func:`receive` keeps it for
the layers of that step, which read it with :func:`current`. Both sides import this
module and nothing else of each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

ATTRIBUTE = "specexpert_demand"
"""Name of the attribute on ``SchedulerOutput``."""


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

    def scored(self, layer: int, router_ids: np.ndarray, stats: Any) -> StepDemand | None:
        """This demand if it covers a decode call of ``layer`` on ``router_ids``' tokens,
        scored against the experts they chose (``stats.path_needed``/``path_covered``:
        the path predictor's batch-level accuracy); ``None`` otherwise."""
        if self.tokens not in (None, router_ids.shape[0]) or layer not in self.layers:
            return None  # not this pass's decode tokens
        used = np.unique(router_ids)
        stats.path_needed += len(used)
        stats.path_covered += int(np.count_nonzero(self.layers[layer][used]))
        return self


_current: StepDemand | None = None


def attach(scheduler_output: Any, demand: StepDemand) -> None:
    """Scheduler side: send ``demand`` with the step's ``SchedulerOutput``."""
    setattr(scheduler_output, ATTRIBUTE, demand)


def receive(scheduler_output: Any) -> None:
    """Worker side, as a step starts: keep its demand (``None`` without one)."""
    global _current
    _current = getattr(scheduler_output, ATTRIBUTE, None)


def current() -> StepDemand | None:
    """The running step's demand (``None``: no prediction for it)."""
    return _current
