"""The quality budget's decisions: sampled tokens' figures summed per decode batch class,
judged per window against the limits, and the switch of a class to exact and back
(each logged once). See :mod:`vllm_specexpert.quality`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

from vllm_specexpert.config.sections import QualityConfig
from vllm_specexpert.log import init_logger

logger = init_logger(__name__)


@dataclass
class Judged:
    """Sampled tokens' figures summed: over a window, a batch class or everything."""

    tokens: int = 0
    flips: int = 0
    accuracy_loss: float = 0.0
    """Sum of ``p[exact top-1] - p[approximate top-1]``."""
    exact_confidence: float = 0.0
    """Sum of ``p[exact top-1]`` (the accuracy loss's denominator)."""
    loss_squares: float = 0.0
    """Sums of the tokens' squares and products (the ratio's variance): ``loss**2``, ..."""
    confidence_squares: float = 0.0
    """... ``confidence**2`` ..."""
    loss_confidence: float = 0.0
    """... and ``loss * confidence``."""

    def add(self, other: Judged) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def flip_rate(self) -> float | None:
        return self.flips / self.tokens if self.tokens else None

    @property
    def accuracy_loss_share(self) -> float | None:
        return self.accuracy_loss / self.exact_confidence if self.exact_confidence else None

    def accuracy_loss_bound(self, z: float) -> float | None:
        """The share's one-sided upper bound at ``z`` standard errors: the ratio
        estimator's (delta method, the tokens as draws of (loss, confidence) pairs)."""
        share = self.accuracy_loss_share
        if share is None:
            return None
        residuals = (
            self.loss_squares
            - 2 * share * self.loss_confidence
            + share**2 * self.confidence_squares
        )
        variance = max(residuals, 0.0) / max(self.tokens - 1, 1)
        return share + z * math.sqrt(self.tokens * variance) / self.exact_confidence

    def flip_rate_bound(self, z: float) -> float | None:
        """The flip rate's one-sided upper bound at ``z`` (Wilson's score bound)."""
        if not self.tokens:
            return None
        n, rate = self.tokens, self.flips / self.tokens
        spread = z * math.sqrt(rate * (1 - rate) / n + z**2 / (4 * n**2))
        return (rate + z**2 / (2 * n) + spread) / (1 + z**2 / n)


@dataclass
class BatchClass:
    """The decode passes of ``low``..``high`` sequences, judged and switched apart."""

    low: int
    high: int | None
    """``None``: no upper bound."""
    exact: bool = False
    """Whether these passes run exactly because a window was over budget."""
    window: Judged = field(default_factory=Judged)
    total: Judged = field(default_factory=Judged)
    last_window: Judged | None = None
    exact_passes: int = 0

    @property
    def judged(self) -> bool:
        """Whether a window of this class has ended: until then its passes run the mode
        unjudged (its sampled tokens are fewer than ``quality.window``, and none was so far
        over budget that the window could not end under it)."""
        return self.last_window is not None

    @property
    def label(self) -> str:
        if self.high is None:
            return f"{self.low}+"
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"

    def stats(self, z: float) -> dict:
        """Its figures; the last window's upper bounds at ``z`` (what it was judged by)."""
        last = self.last_window
        return {
            "exact": self.exact,
            "judged": self.judged,
            "window_tokens": self.window.tokens,
            "sampled_tokens": self.total.tokens,
            "top1_flip_rate": self.total.flip_rate,
            "accuracy_loss": self.total.accuracy_loss_share,
            "exact_passes": self.exact_passes,
            "last_window_flip_rate": last.flip_rate if last else None,
            "last_window_accuracy_loss": last.accuracy_loss_share if last else None,
            "last_window_flip_rate_bound": last.flip_rate_bound(z) if last else None,
            "last_window_accuracy_loss_bound": last.accuracy_loss_bound(z) if last else None,
        }


def batch_classes(bounds: tuple[int, ...]) -> list[BatchClass]:
    """The classes of ``quality.batch_classes``' upper bounds."""
    lows = (1, *(b + 1 for b in bounds))
    return [BatchClass(low, high) for low, high in zip(lows, (*bounds, None), strict=True)]


class Budget:
    """One engine's batch classes under ``quality``'s limits (see module doc)."""

    def __init__(self, config: QualityConfig) -> None:
        self.config = config
        self.z = NormalDist().inv_cdf(config.confidence)
        """Standard errors of the upper bounds judged (0: the point estimates)."""
        self.classes = batch_classes(config.batch_classes)
        self.windows = 0
        self.switches_to_exact = 0
        self.switches_to_approximate = 0

    def class_of(self, num_rows: int) -> BatchClass:
        """The batch class of a decode pass of ``num_rows`` sequences."""
        return next(c for c in self.classes if c.high is None or num_rows <= c.high)

    def exact_for(self, num_rows: int) -> bool:
        """Whether a decode pass of ``num_rows`` sequences runs exactly (over budget)."""
        return self.class_of(num_rows).exact

    def over_budget(self, judged: Judged, remaining: int = 0) -> str | None:
        """Why ``judged`` is over budget (the figure and its limit), or ``None``: an
        ended window's upper bounds at ``quality.confidence`` against the limits. With
        ``remaining`` tokens still to come in its window: whether its point estimate will
        be over whatever they are (each adds a loss of at least 0 to a confidence of at
        most 1, and at least 0 flips), and so its bound too."""
        config = self.config
        if remaining:
            loss = (
                judged.accuracy_loss / (judged.exact_confidence + remaining)
                if judged.exact_confidence + remaining
                else None
            )
            flips = judged.flips / (judged.tokens + remaining) if judged.tokens else None
            how = "at least "
        else:
            loss = judged.accuracy_loss_bound(self.z)
            flips = judged.flip_rate_bound(self.z)
            how = "" if self.z == 0 else f"up to (one-sided {config.confidence:.0%} bound) "
        for figure, value, limit in (
            ("accuracy loss", loss, config.max_accuracy_loss),
            ("top-1 flip rate", flips, config.max_top1_flip),
        ):
            if limit is not None and value is not None and value > limit:
                return f"{figure} {how}{value:.3f} > {limit:.3f}"
        return None

    def judge(self, batch: BatchClass) -> None:
        """Ends the class's window when it is full, or, while the mode runs, as soon as
        it cannot end under budget (a mode far over budget is caught in a fraction of a
        window); switches if the window says so."""
        window = batch.window
        remaining = self.config.window - window.tokens
        if remaining > 0 and (batch.exact or self.over_budget(window, remaining) is None):
            return
        batch.last_window, batch.window = window, Judged()
        self.windows += 1
        over = self.over_budget(window, max(remaining, 0))
        if not batch.exact and over is not None:
            batch.exact = True
            self.switches_to_exact += 1
            logger.warning(
                "specexpert: quality: decode passes of %s sequence(s): %s over "
                "the last %d sampled tokens: running them exactly (fetch) until "
                "a window is under budget",
                batch.label,
                over,
                window.tokens,
            )
        elif batch.exact and over is None:
            batch.exact = False
            self.switches_to_approximate += 1
            logger.warning(
                "specexpert: quality: decode passes of %s sequence(s): the "
                "approximate mode is within budget over the last %d sampled "
                "tokens (accuracy loss %.3f, top-1 flip rate %.3f; one-sided %.0f%% "
                "bounds %.3f, %.3f): running it again",
                batch.label,
                window.tokens,
                window.accuracy_loss_share,
                window.flip_rate,
                100 * self.config.confidence,
                window.accuracy_loss_bound(self.z),
                window.flip_rate_bound(self.z),
            )

    def stats(self) -> dict:
        return {
            "windows": self.windows,
            "switches_to_exact": self.switches_to_exact,
            "switches_to_approximate": self.switches_to_approximate,
        }

    def reset_stats(self) -> None:
        self.windows = self.switches_to_exact = self.switches_to_approximate = 0
        for batch in self.classes:
            batch.total, batch.exact_passes = Judged(), 0
