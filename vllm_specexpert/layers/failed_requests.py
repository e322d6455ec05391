"""Worker side of failing the requests whose experts could not be read: after each step,
the rows the engine ran without an expert (:attr:`OffloadEngine.unreadable`) become
the ids of their requests on the step's ``ModelRunnerOutput``
(:func:`vllm_specexpert.handback.attach_failed`), which the plugin's scheduler fails
(:mod:`vllm_specexpert.schedule.scheduler`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from vllm_specexpert import handback, vllm_hooks
from vllm_specexpert.layers.engines import engine_of


def install() -> None:
    """Carry failed requests back with every step's output (idempotent)."""
    vllm_hooks.at_step_end(_carry_failed)


def _carry_failed(runner: Any, scheduler_output: Any, output: Any) -> Any:
    engine = engine_of(runner.vllm_config)
    rows = engine.unreadable.take() if engine is not None else []
    if not rows or scheduler_output is None:
        return output
    requests = requests_of_rows(
        rows, list(runner.input_batch.req_ids), scheduler_output.num_scheduled_tokens
    )
    return handback.attach_failed(output, requests)


def requests_of_rows(
    rows: Sequence[int], req_ids: Sequence[str], num_scheduled_tokens: Mapping[str, int]
) -> list[str]:
    """The requests of the pass's token ``rows``: vLLM lays a pass's tokens out request by
    request, in the input batch's order, ``num_scheduled_tokens`` each (rows past the
    last, a compiled graph's padding, belong to none)."""
    ends = np.cumsum([num_scheduled_tokens[r] for r in req_ids])
    index = np.searchsorted(ends, np.asarray(rows), side="right")
    return sorted({req_ids[i] for i in index.tolist() if i < len(req_ids)})
