"""The speculative governor: the draft length ``k`` of each step, and which requests draft.

MoE-SpeQ's governor (§3.2): maximize accepted tokens per second, ``E[tokens](k) / T(k)``
over ``k`` in ``0..k_max``, both measured online:

* ``E[tokens](k) = sum_{i=0..k} a^i`` per request, ``a`` an EMA of its per-token
  acceptance (accepted / drafted tokens tested up to the first rejection).
* ``T(k)``: the measured cycle (a round's ``k`` drafts plus the verifying pass and its
  expert stalls), per (batch-size bucket, ``k``): the median of the last 8
  samples shrunk toward a line through every ``k``'s median. Each ``k`` is tried
  ``WARM_UP_SAMPLES`` times (first sample dropped: cold cache), a neighbour every
  ``PROBE_EVERY`` steps.

With ``explore_after_tokens`` (``lookahead.explore_after_tokens``), a bucket drafts
nothing (``k = 0``, whose round runs none of the draft's experts) until it has decoded
that many tokens, so that a run of a few tokens never pays for the warm-up.

A request below the break-even acceptance ``a*`` (``E(k, a*) = T(k) / T(0)``) stops
drafting and drafts again every ``PROBE_EVERY`` of its own steps (Cascade's utility
gate). Details: docs/design.md, "Draft lookahead (MoE-SpeQ)".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from vllm_specexpert.planner.measured import MeasuredCosts, bucket
from vllm_specexpert.stats import Counters, counter, seconds

PROBE_EVERY = 16
"""Steps between two re-measurements (a neighbouring ``k``, a stopped request)."""
EMA = 0.2
"""Weight of the newest measurement in every moving average."""
PRIOR_ACCEPTANCE = 0.7
"""Acceptance assumed for a request before its first verification."""
WARM_UP_SAMPLES = 2
"""Cycle samples per (bucket, k) before the governor chooses; the first is dropped."""
FIT_WEIGHT = 2.0
"""Weight, in samples, of the bucket's straight-line fit in a k's cycle estimate."""


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verification yields for a draft of ``k`` (the target's own included)."""
    return sum(acceptance**i for i in range(k + 1))


@dataclass(frozen=True)
class DraftRound:
    """One draft round (its time is half of a cycle sample, module doc)."""

    bucket: int
    """Batch-size bucket of the round's requests."""
    k: int
    seconds: float
    """The draft's time."""


@dataclass
class GovernorStats(Counters):
    """Counters of the governor (reported under ``lookahead`` in the stats)."""

    steps: int = counter("Steps the governor chose a draft length for.")
    steps_by_k: dict[int, int] = field(default_factory=dict)
    """Steps per chosen draft length."""
    last_k: int | None = None
    """The draft length chosen last."""
    drafted: int = counter("Drafted tokens that were verified.")
    accepted: int = counter("Drafted tokens the target accepted.")
    stopped_request_steps: int = counter(
        "Request-steps without drafts because the request's drafts did not pay."
    )
    draft_s: float = seconds("Seconds of the draft's rounds.")

    def to_dict(self) -> dict:
        return {
            **self.counts(),
            "steps_by_k": {str(k): n for k, n in sorted(self.steps_by_k.items())},
            "last_k": self.last_k,
            "acceptance": self.accepted / self.drafted if self.drafted else None,
        }


class Governor:
    """Chooses each step's draft length and drafting requests (module doc)."""

    def __init__(
        self, k_max: int, fixed_k: int | None = None, explore_after_tokens: int = 0
    ) -> None:
        self.k_max = k_max
        self.fixed_k = fixed_k
        self.explore_after_tokens = explore_after_tokens
        self.seen: dict[int, int] = {}
        """Batch bucket -> decode tokens it has run (a step's requests each count one)."""
        self.acceptance: dict[str, float] = {}
        self.cycles: MeasuredCosts[tuple[int, int]] = MeasuredCosts()
        """(batch bucket, k) -> its recent cycle samples, in seconds."""
        self._estimates: dict[tuple[int, int], float | None] = {}
        """:meth:`cycle_s` until the next sample (a step's choice asks it many times)."""
        self.stopped: dict[str, int] = {}
        """Request -> its steps since it stopped drafting."""
        self.stats = GovernorStats()
        self._step = 0
        self._rounds: dict[int, DraftRound] = {}
        """Round number -> a round whose drafts some request has still to verify."""
        self._round_of: dict[str, int] = {}
        """Request -> the round it drafted in last."""
        self._next_round = 0

    def reset_stats(self) -> None:
        self.stats = GovernorStats()

    # ------------------------------------------------------------- measurements

    def verified(
        self, results: dict[str, tuple[int, int]], requests: list[str], pass_s: float | None
    ) -> None:
        """A target pass verified drafts: ``results``: request -> (drafted, accepted);
        ``pass_s``: seconds since the last round ended, ``None`` when the pass did more
        than verify (a prompt, a chunk: no cycle sample)."""
        for request, (drafted, accepted) in results.items():
            if drafted <= 0:
                continue
            tested = accepted + (1 if accepted < drafted else 0)
            rate = accepted / tested
            old = self.acceptance.get(request, PRIOR_ACCEPTANCE)
            self.acceptance[request] = (1 - EMA) * old + EMA * rate
            self.stats.drafted += drafted
            self.stats.accepted += accepted
        numbers = {self._round_of.get(request) for request in requests}
        if pass_s is None or not requests or None in numbers:
            return
        rounds = [self._rounds[n] for n in numbers if n is not None]
        if len({(r.bucket, r.k) for r in rounds}) > 1:
            return  # (drafts of different lengths or batch sizes: no one k's cycle)
        draft_s = sum(r.seconds for r in rounds) / len(rounds)
        if self.cycles.add((rounds[0].bucket, rounds[0].k), draft_s + pass_s):
            self._estimates.clear()

    def cycle_s(self, batch: int, k: int) -> float | None:
        """Estimated cycle seconds at draft length ``k``; ``None`` before a sample."""
        key = (bucket(batch), k)
        if key not in self._estimates:
            self._estimates[key] = self._estimate(*key)
        return self._estimates[key]

    def _estimate(self, batch_bucket: int, k: int) -> float | None:
        median = self.cycles.median((batch_bucket, k))
        if median is None:
            return None
        points = [(j, m) for (b, j), m in self.cycles.medians().items() if b == batch_bucket]
        if len(points) < 2:
            return median
        ks, ts = np.array(points, dtype=np.float64).T
        slope, intercept = np.polyfit(ks, ts, 1)  # through each k's median: robust
        fitted = max(intercept + slope * k, 1e-9)
        kept = self.cycles.kept((batch_bucket, k))
        return (kept * median + FIT_WEIGHT * fitted) / (kept + FIT_WEIGHT)

    def drafted(self, requests: list[str], k: int, seconds: float) -> None:
        """The draft ran a round of ``k`` tokens for ``requests`` in ``seconds``."""
        number = self._next_round
        self._next_round += 1
        self.stats.draft_s += seconds
        self._rounds[number] = DraftRound(bucket(len(requests)), k, seconds)
        self._round_of.update(dict.fromkeys(requests, number))
        live = set(self._round_of.values())
        self._rounds = {n: r for n, r in self._rounds.items() if n in live}

    def finished(self, request: str) -> None:
        self.acceptance.pop(request, None)
        self.stopped.pop(request, None)
        self._round_of.pop(request, None)

    # ------------------------------------------------------------------ choices

    def choose(self, requests: list[str]) -> int:
        """The draft length of this step for the running ``requests``."""
        self._step += 1
        k = self.fixed_k if self.fixed_k is not None else self._best_k(requests)
        self.stats.steps += 1
        self.stats.steps_by_k[k] = self.stats.steps_by_k.get(k, 0) + 1
        self.stats.last_k = k
        return k

    def _best_k(self, requests: list[str]) -> int:
        batch_bucket = bucket(len(requests))
        seen = self.seen.get(batch_bucket, 0)
        self.seen[batch_bucket] = seen + len(requests)
        if seen < self.explore_after_tokens:
            return 0  # (its cycles are measured meanwhile: the warm-up then tries the others)
        for round_ in range(1, WARM_UP_SAMPLES + 1):  # warm-up, round robin
            for k in range(self.k_max, -1, -1):
                if self.cycles.taken.get((batch_bucket, k), 0) < round_:
                    return k
        best = max(range(self.k_max + 1), key=lambda k: self.throughput(requests, k))
        if self._step % PROBE_EVERY == 0:
            return max(0, min(self.k_max, best + (1 if (self._step // PROBE_EVERY) % 2 else -1)))
        return best

    def throughput(self, requests: list[str], k: int) -> float:
        """Modeled accepted tokens per second of the batch at draft length ``k``."""
        cycle = self.cycle_s(len(requests), k)
        if not cycle:
            return 0.0
        drafting = self._drafting(requests, k)
        return (
            sum(
                expected_tokens(self.acceptance.get(r, PRIOR_ACCEPTANCE), k)
                if r in drafting
                else 1.0
                for r in requests
            )
            / cycle
        )

    def break_even(self, batch: int, k: int) -> float | None:
        """Acceptance ``a*`` with ``E(k, a*) = T(k) / T(0)`` (``None``: not measured)."""
        if k == 0:
            return None
        base, cycle = self.cycle_s(batch, 0), self.cycle_s(batch, k)
        if not base or not cycle:
            return None
        target = cycle / base
        if target <= 1.0:
            return 0.0
        if target >= k + 1:
            return 1.0
        low, high = 0.0, 1.0
        for _ in range(30):  # E(k, a) increases with a
            mid = (low + high) / 2
            low, high = (mid, high) if expected_tokens(mid, k) < target else (low, mid)
        return high

    def _drafting(self, requests: list[str], k: int) -> set[str]:
        """The requests that draft at length ``k``: those whose acceptance pays for it,
        and a stopped one on its probe step."""
        if self.fixed_k is not None or k == 0:
            return set(requests)
        threshold = self.break_even(len(requests), k)
        if threshold is None or math.isclose(threshold, 0.0):
            return set(requests)
        drafting = set()
        for request in requests:
            steps = self.stopped.get(request)
            if steps is not None and (steps + 1) % PROBE_EVERY == 0:
                drafting.add(request)  # probe
            elif self.acceptance.get(request, PRIOR_ACCEPTANCE) >= threshold:
                drafting.add(request)
        return drafting

    def drafting(self, requests: list[str], k: int) -> set[str]:
        """The requests that keep their ``k`` drafts this step; updates which are stopped."""
        chosen = self._drafting(requests, k)
        threshold = self.break_even(len(requests), k) or 0.0
        for request in requests:
            steps = self.stopped.get(request)
            if request in chosen and self.acceptance.get(request, PRIOR_ACCEPTANCE) >= threshold:
                self.stopped.pop(request, None)
            elif steps is not None:
                self.stopped[request] = steps + 1  # (a probe's step included)
            elif request not in chosen:
                self.stopped[request] = 0
            if request not in chosen:
                self.stats.stopped_request_steps += 1
        return chosen
