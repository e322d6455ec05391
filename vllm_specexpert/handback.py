"""What the workers hand back to the scheduler process: the requests of a step whose
output lacks an expert the slow tier could not read.

The engine keeps the rows of the running pass that needed such an expert
(:class:`UnreadableRows`, filled by :func:`vllm_specexpert.execute.execute_without`); after the
step the worker maps them to their requests (:mod:`vllm_specexpert.layers.failed_requests`)
and attaches those to the step's ``ModelRunnerOutput`` (:func:`attach_failed`, a copy of
it); the plugin's scheduler reads them in ``update_from_output`` (:func:`failed_requests`)
and fails those requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from vllm_specexpert.log import init_logger

logger = init_logger(__name__)

FAILED_ATTRIBUTE = "specexpert_failed_requests"
"""Name of the failed requests' attribute on ``ModelRunnerOutput``."""


FAILS_REQUESTS = "the requests that need them fail with an error, the others go on"
PROPOSES_WITHOUT = (
    "the lookahead draft proposes without them (the target verifies every drafted "
    "token: the output is unchanged)"
)
"""What becomes of a pass that lacks an expert, as logged: a target's requests fail; a
draft's proposals are only checked by its target, so nothing fails."""


class UnreadableRows:
    """The rows of the running pass whose output lacks an expert the slow tier could not
    supply (the worker fails their requests after the step; a draft's engine,
    ``draft``, keeps none), and which experts were logged: each once, with its cause
    and what became of the pass, however often it fails."""

    def __init__(self, draft: bool = False) -> None:
        self._rows: set[int] = set()
        self._logged: set[tuple[str, int]] = set()
        self.draft = draft
        self.outcome = PROPOSES_WITHOUT if draft else FAILS_REQUESTS

    def add(self, rows: Iterable[int]) -> None:
        if not self.draft:
            self._rows.update(rows)

    def take(self) -> list[int]:
        """The rows since the last take."""
        rows, self._rows = sorted(self._rows), set()
        return rows

    def log(self, layer: str, causes: Mapping[int, str], when: str = "") -> None:
        """Log the experts of ``causes`` (each with its own) not logged before, a line
        per cause (``when``: what read them, if not a call)."""
        new = [e for e in sorted(causes) if (layer, e) not in self._logged]
        self._logged.update((layer, e) for e in new)
        by_cause: dict[str, list[int]] = {}
        for expert in new:
            by_cause.setdefault(causes[expert], []).append(expert)
        for cause, experts in by_cause.items():
            logger.error(
                "specexpert: %s: experts %s could not be read (%s); %s (read again when "
                "next needed; logged once per expert)",
                layer,
                experts,
                when + cause,
                self.outcome,
            )


def attach_failed(model_runner_output: Any, request_ids: list[str]) -> Any:
    """Worker side: a copy of the step's output that carries ``request_ids`` (the
    output may be vLLM's shared empty one, never written to)."""
    import copy

    output = copy.copy(model_runner_output)
    setattr(output, FAILED_ATTRIBUTE, list(request_ids))
    return output


def failed_requests(model_runner_output: Any) -> list[str]:
    """Scheduler side: the requests a step's output says failed (none: ``[]``)."""
    return list(getattr(model_runner_output, FAILED_ATTRIBUTE, None) or ())
