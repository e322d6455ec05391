"""A technique switched on only where it pays, as measured: per batch-size bucket, the wall
time per decode token of the steps that run it against the steps that do not. No model
of the bytes or the overlap: what a technique saves and what it costs (reads for
nothing, a held-back sequence's wait, the engine's own work) are both in the time. The
token scheduler's grouping (its governor) and a predictor's prefetch each have one.

A step's sample is the wall time from its start to the next step's start, divided by its
decode tokens; a step that also ran a prompt or a chunk is no sample. Per bucket, each
choice runs ``WARM_UP_STEPS`` steps in a row (the first sample after a switch
dropped: its cache is the other choice's), then the cheaper median runs, and the other
is tried again for ``PROBE_STEPS`` after every ``PROBE_TOKENS`` decode tokens of the
bucket, so a change of workload is seen. Counted in tokens, not steps, the trials take
about the same share of the time either way round: with one choice 1.5x the other's
cost per token, they cost under 2 % of the throughput. The technique warms up first,
unless the switch is made with ``explore_after_tokens``: then the bucket starts without
it and first tries it after that many decode tokens, so that a run of a few tokens never
pays for the trial (the token scheduler's grouping, which holds sequences back).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_specexpert.log import init_logger
from vllm_specexpert.planner.measured import MeasuredCosts, bucket

logger = init_logger(__name__)

WARM_UP_STEPS = 4
"""Steps of each choice, in a row, before the switch compares them (3 samples kept)."""
PROBE_TOKENS = 2048
"""Decode tokens of a bucket between two probes of the choice not taken."""
PROBE_STEPS = 3
"""Steps a probe runs (its first sample dropped)."""
EXPLORE_AFTER_TOKENS = 512
"""The token scheduler's: decode tokens of a bucket, run without grouping, before it is
first tried: its warm-up then costs at most about 2 % of what ran before (4 steps at
1.14x, issue 66's token scheduler at 16 sequences), and a short run (issue 66: 6-12
tokens of 16 sequences, where the grouped warm-up cost 10-12 %) runs as without it
(``lookahead.explore_after_tokens`` is the draft governor's, the same by default)."""


@dataclass
class _Bucket:
    """The choices of one batch-size bucket."""

    tokens: int = 0
    """Decode tokens of this bucket since its last probe."""
    seen: int = 0
    """Decode tokens of this bucket in all."""
    last: bool | None = None
    """Whether its last step ran the technique (``None``: no step yet)."""
    probe_left: int = 0
    """Steps the running probe has still to run after this one."""
    best: bool | None = None
    """Whether the technique measured cheaper, last time both were compared."""


class MeasuredSwitch:
    """Whether each step runs a technique (module doc). ``name``: what it switches, for
    the log."""

    def __init__(
        self,
        name: str,
        clock: Callable[[], float] = time.perf_counter,
        explore_after_tokens: int | None = None,
    ) -> None:
        self.name = name
        self.clock = clock
        self.explore_after_tokens = explore_after_tokens
        self.costs: MeasuredCosts[tuple[int, bool]] = MeasuredCosts()
        """(batch bucket, on) -> recent seconds per decode token."""
        self.buckets: dict[int, _Bucket] = {}
        self._started = 0.0
        """When the step in flight was scheduled."""
        self._choice: tuple[int, bool] | None = None
        """The key of the step in flight's choice (``None``: it made none)."""
        self._pending: tuple[tuple[int, bool], float, int] | None = None
        """The step in flight, if it is a sample: its key, start and decode tokens."""

    def step_started(self) -> None:
        """A step began: the step before it, if it was a sample, ends now."""
        now = self.clock()
        if self._pending is not None:
            key, started, tokens = self._pending
            self.costs.add(key, (now - started) / tokens)
        self._started, self._choice, self._pending = now, None, None

    def on(self, batch: int) -> bool:
        """Whether this step, of ``batch`` decode sequences, runs the technique."""
        batch_bucket = bucket(batch)
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
        state = self.buckets[self._choice[0]]
        state.tokens += decode_tokens
        state.seen += decode_tokens
        if decode_only and decode_tokens > 0:
            self._pending = (self._choice, self._started, decode_tokens)

    def _choose(self, batch_bucket: int, state: _Bucket) -> bool:
        explore = self.explore_after_tokens
        for choice in (True, False) if explore is None else (False, True):  # warm-ups
            if self.costs.kept((batch_bucket, choice)) < WARM_UP_STEPS - 1:
                return choice and (explore is None or state.seen >= explore)
        on = self.costs.median((batch_bucket, True))
        off = self.costs.median((batch_bucket, False))
        assert on is not None and off is not None  # (both warmed up)
        best = on < off
        if best != state.best:
            state.best = best
            logger.info(
                "specexpert: %s: %d-%d decode sequences: %.4f s per token with it, %.4f s "
                "without (median of recent steps): %s",
                self.name,
                batch_bucket // 2 + 1,
                batch_bucket,
                on,
                off,
                "on" if best else "off",
            )
        if state.probe_left:
            state.probe_left -= 1
            return not best
        if state.tokens >= PROBE_TOKENS:
            state.tokens, state.probe_left = 0, PROBE_STEPS - 1
            return not best
        return best

    def stats(self) -> dict:
        """Per bucket: the median seconds per decode token with the technique and
        without, measured."""
        return {
            str(b): {
                "on_s_per_token": self.costs.median((b, True)),
                "off_s_per_token": self.costs.median((b, False)),
            }
            for b in sorted(self.buckets)
        }
