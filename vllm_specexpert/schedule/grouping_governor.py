"""The token scheduler's governor: it groups only where grouping pays, as measured.

Grouping pays when a generated token costs less wall time with one group per step than
with every runnable sequence per step: a smaller group reads fewer experts per step, but
each is amortised over fewer tokens, and the held-back sequences wait (routes change from
token to token, so on a cache that already holds most of a step's experts it seldom
pays). Both costs are measured here, in the scheduler process, with no model of the
bytes: a step's sample is the wall time from its ``schedule()`` to the next one, divided
by its decode tokens. A step that also ran a prompt or a chunk is no sample.

Per batch-size bucket of runnable decode sequences, each choice runs ``WARM_UP_STEPS``
steps in a row (the first sample after a switch dropped: its cache is the other
choice's), then the cheaper median runs, and the other is tried again for
``PROBE_STEPS`` after every ``PROBE_TOKENS`` decode tokens of the bucket, so a change of
workload is seen. Counted in tokens, not steps, the probes take about the same share of
the time either way round: with one choice 1.5x the other's cost per token, they cost
under 2 % of the throughput.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_specexpert.log import init_logger
from vllm_specexpert.planner.measured import MeasuredCosts, bucket

logger = init_logger(__name__)

WARM_UP_STEPS = 4
"""Steps of each choice, in a row, before the governor compares them (3 samples kept)."""
PROBE_TOKENS = 2048
"""Decode tokens of a bucket between two probes of the choice not taken."""
PROBE_STEPS = 3
"""Steps a probe runs (its first sample dropped)."""


@dataclass
class _Bucket:
    """The choices of one batch-size bucket."""

    tokens: int = 0
    """Decode tokens of this bucket since its last probe."""
    last: bool | None = None
    """Whether its last step grouped (``None``: no step yet)."""
    probe_left: int = 0
    """Steps the running probe has still to run after this one."""
    best: bool | None = None
    """Whether grouping measured cheaper, last time both were compared."""


class GroupingGovernor:
    """Whether each step runs one group or every runnable sequence (module doc)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.costs: MeasuredCosts[tuple[int, bool]] = MeasuredCosts()
        """(batch bucket, grouping) -> recent seconds per decode token."""
        self.buckets: dict[int, _Bucket] = {}
        self._started = 0.0
        """When the step in flight was scheduled."""
        self._choice: tuple[int, bool] | None = None
        """The key of the step in flight's choice (``None``: it made none)."""
        self._pending: tuple[tuple[int, bool], float, int] | None = None
        """The step in flight, if it is a sample: its key, start and decode tokens."""

    def step_started(self) -> None:
        """A ``schedule()`` began: the step before it, if it was a sample, ends now."""
        now = self.clock()
        if self._pending is not None:
            key, started, tokens = self._pending
            self.costs.add(key, (now - started) / tokens)
        self._started, self._choice, self._pending = now, None, None

    def grouping(self, runnable: int) -> bool:
        """Whether this step runs one group of the ``runnable`` decode sequences."""
        batch_bucket = bucket(runnable)
        state = self.buckets.setdefault(batch_bucket, _Bucket())
        choice = self._choose(batch_bucket, state)
        if choice != state.last:  # the first step after a switch meets the other's cache
            self.costs.restart((batch_bucket, choice))
        state.last = choice
        self._choice = (batch_bucket, choice)
        return choice

    def scheduled(self, decode_tokens: int, decode_only: bool) -> None:
        """What the step in flight runs: it is a sample when it made a choice and runs
        decode tokens only."""
        if self._choice is None:
            return
        self.buckets[self._choice[0]].tokens += decode_tokens
        if decode_only and decode_tokens > 0:
            self._pending = (self._choice, self._started, decode_tokens)

    def _choose(self, batch_bucket: int, state: _Bucket) -> bool:
        for choice in (True, False):  # warm-up: grouping first, then all, in a row
            if self.costs.kept((batch_bucket, choice)) < WARM_UP_STEPS - 1:
                return choice
        group = self.costs.median((batch_bucket, True))
        every = self.costs.median((batch_bucket, False))
        assert group is not None and every is not None  # (both warmed up)
        best = group < every
        if best != state.best:
            state.best = best
            logger.info(
                "specexpert: token scheduler: %d-%d runnable decode sequences: %.4f s "
                "per token grouped, %.4f s running all (median of recent steps): %s",
                batch_bucket // 2 + 1,
                batch_bucket,
                group,
                every,
                "grouping" if best else "not grouping",
            )
        if state.probe_left:
            state.probe_left -= 1
            return not best
        if state.tokens >= PROBE_TOKENS:
            state.tokens, state.probe_left = 0, PROBE_STEPS - 1
            return not best
        return best

    def stats(self) -> dict:
        """Per bucket: the median seconds per decode token of each choice, measured."""
        return {
            str(b): {
                "grouped_s_per_token": self.costs.median((b, True)),
                "all_s_per_token": self.costs.median((b, False)),
            }
            for b in sorted(self.buckets)
        }
