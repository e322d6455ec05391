"""Which predicted experts are worth prefetching under ``fetch``.

When the link is the bottleneck (a GPU box copying experts over PCIe), a prefetch that
turns out right saves at most the compute it overlaps, ``min(t_copy, t_window)``, where
``t_window`` is the time from the prediction to the next layer's need; one that turns out
wrong costs a whole copy of link time, ``t_copy``, that the router's true misses then
queue behind. So an expert is worth prefetching only when the chance p that the next
layer asks for it satisfies ``p * min(t_copy, t_window) > (1 - p) * t_copy``, i.e.

    p > t_copy / (t_copy + min(t_copy, t_window)).

p comes from the layer's measured precision per predicted rank, counted only over
predictions of experts that were not resident when predicted (the ones a prefetch would
move; popular resident experts are easier to predict and would flatter the estimate),
decayed so it follows the text; an expert that several tokens predict gets
``p = 1 - prod(1 - p_rank)``. Under ``speculate`` (and ``prefetch_filter: all``) every
predicted expert is prefetched.

:class:`PrefetchPlanner` is kept per layer, for the predictions made *for* that layer:
it scores each against the router's choice when the layer runs (:meth:`~PrefetchPlanner.
observe`) and decides what of the next prediction to prefetch (:meth:`~PrefetchPlanner.
prefetch`).
"""

from __future__ import annotations

import time

import numpy as np

from vllm_specexpert.predict import Prediction
from vllm_specexpert.stats import PhaseStats
from vllm_specexpert.tiers.loader import ExpertLoader

DECAY = 0.98
"""Weight of the past in the per-rank precision, per observed forward pass."""


class PrefetchPlanner:
    """Per-layer precision of the predictions made for that layer, the time they had to
    land, and what of a new one to prefetch."""

    def __init__(self, top_k: int) -> None:
        # Optimistic prior (one correct prediction per rank): prefetch at first, learn.
        self.correct = np.ones(top_k)
        self.total = np.ones(top_k)
        self.window_s: float | None = None
        """Running mean of the time from a prediction for this layer to its use."""

    def prefetch(
        self,
        prediction: Prediction,
        loader: ExpertLoader,
        stats: PhaseStats,
        copy_s: float,
        everything: bool,
    ) -> None:
        """Submit the prefetch of ``prediction`` (made for this layer) to its
        ``loader``: every predicted expert if ``everything``, else those whose chance of
        use pays for their link time ``copy_s`` (the others count as skipped)."""
        prediction.made_at = time.perf_counter()  # the prefetch's window starts now
        if everything:
            loader.prefetch(prediction.experts_by_mass(), stats)
            return
        cache = loader.cache
        ranked = prediction.ranked()
        prediction.considered = cache.expert_slot[ranked] < 0
        window = self.window_s if self.window_s is not None else copy_s
        wanted, skipped = self.plan(ranked, worth_threshold(copy_s, window))
        stats.prefetch_skipped += int(np.count_nonzero(cache.expert_slot[skipped] < 0))
        loader.prefetch(wanted, stats)

    def score(self, prediction: Prediction, router_ids: np.ndarray, stats: PhaseStats) -> None:
        """The layer ran: score ``prediction`` against its router's ``router_ids``."""
        window = time.perf_counter() - prediction.made_at
        self.window_s = window if self.window_s is None else 0.9 * self.window_s + 0.1 * window
        stats.predicted += router_ids.size
        stats.predicted_correct += self.observe(
            prediction.ranked(), router_ids, prediction.considered
        )

    @property
    def precision(self) -> np.ndarray:
        """``[top_k]``: P(router chose it | predicted at rank j)."""
        return self.correct / self.total

    def observe(
        self, predicted_ranked: np.ndarray, chosen: np.ndarray, considered: np.ndarray | None = None
    ) -> int:
        """Account one forward pass: ``predicted_ranked [T, K]`` (ids by predicted
        weight, best first) against the router's ``chosen [T, K]``; the precision only
        learns from the ``considered [T, K]`` entries (default: all). Returns the number
        of the router's (token, expert) pairs the prediction contained."""
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
        experts, index = np.unique(predicted_ranked, return_inverse=True)
        log_miss = np.log(np.maximum(1.0 - self.precision, 1e-12))
        weights = np.broadcast_to(log_miss, predicted_ranked.shape).ravel()
        needed = 1.0 - np.exp(np.bincount(index.ravel(), weights=weights, minlength=len(experts)))
        order = np.argsort(-needed, kind="stable")
        experts, needed = experts[order], needed[order]
        if threshold is None:
            return experts, experts[:0]
        keep = needed > threshold
        return experts[keep], experts[~keep]


def worth_threshold(copy_s: float, window_s: float) -> float:
    """Smallest probability of use at which a prefetch pays for its link time."""
    return copy_s / (copy_s + min(copy_s, window_s))
