"""Which predicted experts are worth prefetching under ``fetch``.

A right prefetch saves at most the compute it overlaps, ``min(t_copy, t_window)``
(``t_window``: prediction to need); a wrong one costs a whole copy the true misses queue
behind. So prefetch only when the chance ``p`` of use satisfies

    p > t_copy / (t_copy + min(t_copy, t_window)).

``p`` is the layer's decayed precision per predicted rank, counted only over experts a
launch would have to read when predicted (resident ones, or a mapped pack's pages in the
page cache, are easier and would flatter it: with none counted, ``p`` stayed at its
prior of 1 and a mapped pack read ahead everything predicted); several tokens
predicting one expert give ``1 - prod(1 - p_rank)``. The same ``p`` orders what a
prefetch evicts: the least likely first, never an expert at least as likely as the one
it brings (:meth:`~vllm_specexpert.tiers.loader.ExpertLoader.prefetch`). Under
``speculate`` (and ``prefetch_filter: all``) every predicted expert is prefetched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from vllm_specexpert.planner.bytes_judge import BytesJudge, needed_of
from vllm_specexpert.predict import Prediction
from vllm_specexpert.stats import Counters, PhaseStats, counter
from vllm_specexpert.tiers.loader import ExpertLoader

DECAY = 0.98
"""Weight of the past in the per-rank precision, per observed forward pass."""


@dataclass
class PredictionCounters(Counters):
    """What next-layer prediction counted in one layer and phase (beside the engine's
    counters while the ``prediction`` feature runs)."""

    predicted: int = counter(
        "Router-chosen (token, expert) pairs checked against a prediction made at "
        "the previous layer."
    )
    predicted_correct: int = counter(
        "Of those, pairs the prediction contained: ``predicted_correct / "
        "predicted`` is the online recall@k of the predictor for this layer."
    )
    prefetch_skipped: int = counter(
        "Predicted, non-resident experts not prefetched because their measured "
        "chance of use did not pay for the copy (``prefetch_filter: cost``)."
    )
    speculated_calls: int = counter(
        "Layer calls that ran the predicted experts with the predicted weights "
        "instead of the router's (miss policy ``speculate``; output not exact)."
    )
    router_free_calls: int = counter(
        "Speculated calls that skipped the router, the estimator having predicted the "
        "layer (``router_free``); their prediction is not scored."
    )
    prefetch_judged_off: int = counter(
        "Decode calls of this layer without a prefetch because, on the disk tier, its "
        "ghost residency with the prefetches' reads had loaded more experts than one "
        "without (``planner.bytes_judge``; the prediction for it is not made then)."
    )
    ghost_loads_prefetching: int = counter(
        "Experts the ghost residency with every prefetch's reads would have loaded."
    )
    ghost_loads_not_prefetching: int = counter(
        "Experts the ghost residency without prefetches would have loaded."
    )

    @property
    def recall(self) -> float:
        return self.predicted_correct / self.predicted if self.predicted else 0.0

    def to_dict(self) -> dict:
        return {**self.counts(), "recall": self.recall}


class PrefetchPlanner:
    """Per layer: the precision of the predictions made for it, and what to prefetch.
    With a ``judge`` (the disk tier, where bytes bind), a prefetch is made only while
    the layer's ghost residency with the prefetches' reads loaded no more than one
    without: a read that is used costs nothing more, a wasted one the disk's time.
    Judged off, no prediction is made for the layer (:attr:`predicts`), so the judge's
    window fills with the calls as they ran and the prefetch is tried again once its
    excess has left it (a probe about every ``JUDGE_WINDOW`` calls)."""

    def __init__(self, top_k: int, judge: BytesJudge | None = None) -> None:
        # Optimistic prior (one correct prediction per rank): prefetch at first, learn.
        self.correct = np.ones(top_k)
        self.total = np.ones(top_k)
        self.window_s: float | None = None
        """Running mean of the time from a prediction for this layer to its use."""
        self.judge = judge
        self.judged_on = True
        """The judge's verdict at the layer's last decode call."""

    def prefetch(
        self,
        prediction: Prediction,
        loader: ExpertLoader,
        stats: PhaseStats,
        copy_s: float,
        everything: bool,
        submit: bool = True,
    ) -> None:
        """Prefetch ``prediction``: everything, or the experts whose chance of use pays for
        their link time ``copy_s`` (the others count as skipped). ``submit`` False: decide
        and count, but load nothing (the prefetch is switched off for this pass: what the
        precision learns from is still marked)."""
        prediction.made_at = time.perf_counter()  # the prefetch's window starts now
        if everything:
            loader.prefetch(prediction.experts_by_mass(), stats)
            return
        cache = loader.cache
        ranked = prediction.ranked()
        prediction.considered = cache.needs_read(ranked)  # (a mapped pack: page lookups, once)
        unread = np.zeros(cache.num_experts, dtype=bool)
        unread[ranked[prediction.considered]] = True
        window = self.window_s if self.window_s is not None else copy_s
        wanted, skipped = self.plan(ranked, worth_threshold(copy_s, window))
        counters = stats.part(PredictionCounters)
        counters.prefetch_skipped += int(np.count_nonzero(unread[skipped]))
        if self.judge is not None:  # (what it reads, or would: the time switch's off passes)
            self.judge.ahead(needed_of(wanted, cache.num_experts), cache.policy.keep_rank())
        if submit:
            loader.prefetch(wanted, stats, likelihood=self.likelihood(ranked, cache.num_experts))

    @property
    def predicts(self) -> bool:
        """Whether a prediction for the layer's next call is wanted (module doc)."""
        return self.judge is None or self.judged_on

    def judge_call(self, loader: ExpertLoader, router_ids: np.ndarray, stats: PhaseStats) -> None:
        """The layer's decode call needs ``router_ids`` (``[T, K]``): the judge's ghosts
        serve it, and its verdict holds for the next prefetch."""
        if self.judge is None:
            return
        needed = needed_of(router_ids, loader.cache.num_experts)
        keep = loader.cache.policy.keep_rank()
        judged = self.judge.serve(needed, keep, keep, len(router_ids))
        self.judged_on = judged.on
        counters = stats.part(PredictionCounters)
        counters.ghost_loads_prefetching += judged.technique_loads
        counters.ghost_loads_not_prefetching += judged.plain_loads
        counters.prefetch_judged_off += not judged.on

    def score(self, prediction: Prediction, router_ids: np.ndarray, stats: PhaseStats) -> None:
        """The layer ran: score ``prediction`` against its router's ``router_ids``."""
        window = time.perf_counter() - prediction.made_at
        self.window_s = window if self.window_s is None else 0.9 * self.window_s + 0.1 * window
        counters = stats.part(PredictionCounters)
        counters.predicted += router_ids.size
        counters.predicted_correct += self.observe(
            prediction.ranked(), router_ids, prediction.considered
        )

    @property
    def precision(self) -> np.ndarray:
        """``[top_k]``: P(router chose it | predicted at rank j)."""
        return self.correct / self.total

    def observe(
        self, predicted_ranked: np.ndarray, chosen: np.ndarray, considered: np.ndarray | None = None
    ) -> int:
        """Score ``predicted_ranked [T, K]`` (best first) against the router's ``chosen``,
        learning only from ``considered`` entries; returns the router pairs predicted."""
        hit = (predicted_ranked[:, :, None] == chosen[:, None, :]).any(axis=2)
        mask = np.ones_like(hit) if considered is None else considered
        self.correct = DECAY * self.correct + (hit & mask).sum(axis=0)
        self.total = DECAY * self.total + mask.sum(axis=0)
        return int(hit.sum())

    def plan(
        self, predicted_ranked: np.ndarray, threshold: float | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(wanted, skipped)``: the distinct predicted experts above ``threshold``
        (``None``: all), most likely needed first, and the others."""
        experts, needed = self._needed(predicted_ranked)
        order = np.argsort(-needed, kind="stable")
        experts, needed = experts[order], needed[order]
        if threshold is None:
            return experts, experts[:0]
        keep = needed > threshold
        return experts[keep], experts[~keep]

    def likelihood(self, predicted_ranked: np.ndarray, num_experts: int) -> np.ndarray:
        """``[num_experts]``: each expert's chance of use by the predicted call (0 for the
        unpredicted)."""
        experts, needed = self._needed(predicted_ranked)
        chance = np.zeros(num_experts)
        chance[experts] = needed
        return chance

    def _needed(self, predicted_ranked: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The distinct predicted experts and each one's chance of use:
        ``1 - prod(1 - p_rank)`` over the tokens predicting it."""
        experts, index = np.unique(predicted_ranked, return_inverse=True)
        log_miss = np.log(np.maximum(1.0 - self.precision, 1e-12))
        weights = np.broadcast_to(log_miss, predicted_ranked.shape).ravel()
        needed = 1.0 - np.exp(np.bincount(index.ravel(), weights=weights, minlength=len(experts)))
        return experts, needed


def worth_threshold(copy_s: float, window_s: float) -> float:
    """Smallest probability of use at which a prefetch pays for its link time."""
    return copy_s / (copy_s + min(copy_s, window_s))
