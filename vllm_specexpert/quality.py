"""The quality budget (``quality``): shadow-exact sampling of decode tokens, the
estimated accuracy loss, top-1 flip rate and KL of their final logits, and the switch to
exact, per decode batch size, while over budget.

A sampled share of the decode tokens of each pass is recomputed at every MoE layer
beside the served result: while the mode runs, the exact result of those rows (the
router's experts, fetched: ``fetch``'s arithmetic); while the engine runs exactly
after a switch, the mode's result of the whole call (a substitution gate decides per
call), computed before the exact call loads what is missing. Per sampled token the
monitor keeps ``d_l = other - served`` of every layer. At the model's final norm
(:mod:`vllm_specexpert.layers.final_tap`) it estimates the other result's final hidden
state as ``served + sum_l d_l`` and compares the two tokens' logits through the model's
own final norm and LM head.

The estimate is first order: the differences of the MoE outputs are carried on the
residual stream to the final norm, without recomputing how later layers respond to
them (that would take a second KV cache). The same holds for the per-layer figures
(``served + d_l``: what that layer alone changes). ``benchmarks/quality.py`` compares
the estimated flip rate with the flip rate measured by teacher forcing.

The accuracy loss of a sampled token is ``p[a_exact] - p[a_approx]``, ``p`` the exact
result's next-token probabilities and ``a`` the two top-1 tokens: what the approximate
token would lose in expected accuracy if the exact model were calibrated (a flip between
two near-equal tokens costs almost nothing; a flip away from a confident token costs its
confidence). A window's loss is its sum over the sum of ``p[a_exact]``, the exact
result's expected accuracy: a share, like the 98 % the approximate modes aim at.

Decode passes are judged per batch class (``quality.batch_classes``, by the number of
decode sequences), because a layer call of more tokens misses more experts. Decisions
are per window of ``quality.window`` sampled tokens of one class: over budget, passes
of that class run exactly (``fetch``, no speculation) from the next one on; a later
window under budget switches the class back. Each switch is logged once. While the mode
runs, a window that can no longer end under budget, whatever its remaining tokens, is
judged at once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_specexpert import execute
from vllm_specexpert.config.sections import QualityConfig
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.log import init_logger
from vllm_specexpert.stats import PhaseStats
from vllm_specexpert.tiers.staging import upload

logger = init_logger(__name__)


@dataclass
class LogitHead:
    """The model's final norm and LM head, as tensors (set when the model is wired)."""

    norm_weight: torch.Tensor
    eps: float
    weight: torch.Tensor
    """``[V, H]`` the LM head (rows past ``vocab_size`` are padding)."""
    vocab_size: int
    scale: float = 1.0
    soft_cap: float | None = None

    def logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of pre-norm final hidden states ``[R, H]``."""
        normed = torch.nn.functional.rms_norm(
            final_hidden.float(), (final_hidden.shape[-1],), self.norm_weight.float(), self.eps
        )
        logits = (normed.to(self.weight.dtype) @ self.weight[: self.vocab_size].T).float()
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        return logits * self.scale


def kl_divergence(exact: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """Per row KL(softmax(exact) || softmax(approx)) in nats."""
    log_p, log_q = exact.log_softmax(-1), approx.log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)


@dataclass
class QualityCounters:
    """What the monitor measured since the last reset."""

    kl_sum: float = 0.0
    windows: int = 0
    switches_to_exact: int = 0
    switches_to_approximate: int = 0
    exact_passes: int = 0
    """Decode passes run exactly because of the budget."""
    shadow_calls: int = 0
    shadow_s: float = 0.0
    """Wall time of the shadow computations and the logit comparisons."""
    shadow_bytes: int = 0
    """Bytes the shadow computations loaded (exact rows' missing experts, or the
    mode's own loads while the engine runs exactly)."""
    layer_tokens: dict[int, int] = field(default_factory=dict)
    """Per MoE layer index: sampled tokens whose result that layer changed."""
    layer_flips: dict[int, int] = field(default_factory=dict)
    layer_kl_sum: dict[int, float] = field(default_factory=dict)
    layer_accuracy_loss_sum: dict[int, float] = field(default_factory=dict)


@dataclass
class Judged:
    """Sampled tokens' figures summed: over a window, a batch class or everything."""

    tokens: int = 0
    flips: int = 0
    accuracy_loss: float = 0.0
    """Sum of ``p[exact top-1] - p[approximate top-1]``."""
    exact_confidence: float = 0.0
    """Sum of ``p[exact top-1]`` (the accuracy loss's denominator)."""

    def add(self, other: Judged) -> None:
        self.tokens += other.tokens
        self.flips += other.flips
        self.accuracy_loss += other.accuracy_loss
        self.exact_confidence += other.exact_confidence

    @property
    def flip_rate(self) -> float | None:
        return self.flips / self.tokens if self.tokens else None

    @property
    def accuracy_loss_share(self) -> float | None:
        return self.accuracy_loss / self.exact_confidence if self.exact_confidence else None


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
    def label(self) -> str:
        if self.high is None:
            return f"{self.low}+"
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"

    def stats(self) -> dict:
        last = self.last_window
        return {
            "exact": self.exact,
            "sampled_tokens": self.total.tokens,
            "top1_flip_rate": self.total.flip_rate,
            "accuracy_loss": self.total.accuracy_loss_share,
            "exact_passes": self.exact_passes,
            "last_window_flip_rate": last.flip_rate if last else None,
            "last_window_accuracy_loss": last.accuracy_loss_share if last else None,
        }


def batch_classes(bounds: tuple[int, ...]) -> list[BatchClass]:
    """The classes of ``quality.batch_classes``' upper bounds."""
    lows = (1, *(b + 1 for b in bounds))
    return [BatchClass(low, high) for low, high in zip(lows, (*bounds, None), strict=True)]


class QualityMonitor:
    """One engine's quality budget (see module doc)."""

    def __init__(self, config: QualityConfig, head: LogitHead, first_layer: int) -> None:
        self.config = config
        self.head = head
        self.first_layer = first_layer
        """The index of the first MoE layer: its decode call starts a pass."""
        self.rng = np.random.default_rng(config.seed)
        self.classes = batch_classes(config.batch_classes)
        self.counters = QualityCounters()
        self.total = Judged()
        """Every sampled token since the last reset."""
        self.pass_class = self.classes[0]
        """The batch class of the running pass (set at its first MoE layer)."""
        self.rows: np.ndarray | None = None
        """The running pass's sampled rows (of its decode tokens); ``None``: none."""
        self.num_rows = 0
        self.deltas: dict[int, torch.Tensor] = {}
        """Per layer index: ``other - served`` of the sampled rows ``[R, H]``."""
        self.scratch = PhaseStats()
        """Counters of the shadow computations (kept apart from the mode's)."""

    @classmethod
    def of(
        cls, config: QualityConfig | None, head: LogitHead | None, layers: dict[str, OffloadedLayer]
    ) -> QualityMonitor | None:
        """The monitor of ``config`` (``None`` without a budget, or before the model's
        head is known)."""
        if config is None or head is None or not layers:
            return None
        return cls(config, head, min(layer.index for layer in layers.values()))

    def class_of(self, num_rows: int) -> BatchClass:
        """The batch class of a decode pass of ``num_rows`` sequences."""
        return next(c for c in self.classes if c.high is None or num_rows <= c.high)

    def exact_for(self, num_rows: int) -> bool:
        """Whether a decode pass of ``num_rows`` sequences runs exactly (over budget)."""
        return self.class_of(num_rows).exact

    # ------------------------------------------------------------ per layer call

    def sampled_rows(self, layer_index: int, num_rows: int) -> np.ndarray | None:
        """The rows of a decode call to recompute (drawn at the first MoE layer)."""
        if layer_index == self.first_layer:
            self.deltas = {}
            self.num_rows = num_rows
            self.pass_class = self.class_of(num_rows)
            drawn = np.flatnonzero(self.rng.random(num_rows) < self.config.sample)
            self.rows = drawn if len(drawn) else None
            if self.pass_class.exact:
                self.counters.exact_passes += 1
                self.pass_class.exact_passes += 1
        elif num_rows != self.num_rows:
            self.rows = None  # not the pass the rows were drawn for
        return self.rows

    def resolve(
        self,
        layer: OffloadedLayer,
        approx: LayerCall,
        router_weights: torch.Tensor,
        router_ids: np.ndarray,
        mode: Callable[[LayerCall], torch.Tensor],
    ) -> torch.Tensor:
        """The served output of a decode call: ``mode(approx)`` (the mode: its miss
        policy's plan, run), or the call on the router's routing with every missing
        expert fetched while its batch class is over budget; the other one is computed
        for the sampled rows beside it."""
        rows = self.sampled_rows(layer.index, approx.x.shape[0])
        over_budget = self.exact_for(approx.x.shape[0])
        if rows is None and not over_budget:  # the common case: nothing more to do
            return mode(approx)
        exact = approx.routed(router_weights, router_ids)
        shadow = None
        if over_budget:  # the exact call starts the next layer's prefetch
            exact.before_kernel, approx.before_kernel = approx.before_kernel, None
            if rows is not None:  # before the exact call loads what the mode would miss
                started = time.perf_counter()
                shadow = mode(self._quiet(approx))[upload(rows, approx.x.device)]
                self._charge(started)
            out = execute.run(layer.loader, exact, execute.survey(layer.loader, exact))
        else:
            out = mode(approx)
            if rows is not None:  # ``exact`` shares ``before_kernel``: _quiet drops it
                started = time.perf_counter()
                shadow = execute.run_on_device(layer.loader, self._quiet(exact.rows(rows)))
                self._charge(started)
        if shadow is not None:
            assert rows is not None  # (a shadow is computed for sampled rows only)
            self.deltas[layer.index] = shadow.float() - out[upload(rows, out.device)].float()
        return out

    def _quiet(self, call: LayerCall) -> LayerCall:
        return dataclasses.replace(call, stats=self.scratch, before_kernel=None, fired=None)

    def _charge(self, started: float) -> None:
        self.counters.shadow_calls += 1
        self.counters.shadow_s += time.perf_counter() - started
        self.counters.shadow_bytes += self.scratch.bytes_loaded
        self.scratch = PhaseStats()

    # ------------------------------------------------------------ per pass

    @property
    def pending(self) -> bool:
        """Whether the running pass has sampled rows to compare at the final norm."""
        return self.rows is not None and bool(self.deltas)

    def finish_pass(self, final_hidden: torch.Tensor) -> None:
        """Compare the sampled rows' logits; ``final_hidden``: their served pre-norm
        final hidden states ``[R, H]`` (in the order of the sampled rows)."""
        started = time.perf_counter()
        self.rows = None
        served = final_hidden.float()
        served_logits = self.head.logits(served)
        other = served + sum(self.deltas.values())
        flips, kl, loss, confidence = self._compare(served_logits, self.head.logits(other))
        counters = self.counters
        flip_count, kl_sum, loss_sum, confidence_sum = torch.stack(  # one device read
            [flips.sum().float(), kl.sum(), loss.sum(), confidence.sum()]
        ).tolist()
        counters.kl_sum += kl_sum
        judged = Judged(len(flips), int(flip_count), loss_sum, confidence_sum)
        for into in (self.total, self.pass_class.total, self.pass_class.window):
            into.add(judged)
        for index, delta in self.deltas.items():
            changed = delta.abs().amax(-1) > 0
            if not bool(changed.any()):
                continue
            layer_flips, layer_kl, layer_loss, _ = self._compare(
                served_logits[changed], self.head.logits(served[changed] + delta[changed])
            )
            for key, value in (
                ("layer_tokens", int(changed.sum())),
                ("layer_flips", int(layer_flips.sum())),
                ("layer_kl_sum", float(layer_kl.sum())),
                ("layer_accuracy_loss_sum", float(layer_loss.sum())),
            ):
                per_layer = getattr(counters, key)
                per_layer[index] = per_layer.get(index, 0) + value
        self.deltas = {}
        counters.shadow_s += time.perf_counter() - started
        self._judge(self.pass_class)

    def _compare(self, served: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per row: whether the top-1 token differs, KL(exact || approximate), the
        accuracy loss ``p[exact top-1] - p[approximate top-1]`` and ``p[exact top-1]``
        (``p``: the exact result's probabilities)."""
        exact, approx = (served, other) if self.pass_class.exact else (other, served)
        exact_top1, approx_top1 = exact.argmax(-1, keepdim=True), approx.argmax(-1, keepdim=True)
        probs = exact.softmax(-1)
        confidence = probs.gather(-1, exact_top1).squeeze(-1)
        loss = confidence - probs.gather(-1, approx_top1).squeeze(-1)
        return (
            (exact_top1 != approx_top1).squeeze(-1),
            kl_divergence(exact, approx),
            loss,
            confidence,
        )

    def over_budget(self, judged: Judged, remaining: int = 0) -> str | None:
        """Why ``judged`` is over budget (the figure and its limit), or ``None``. With
        ``remaining`` tokens still to come in its window: whether it will be over
        whatever they are (each adds a loss of at least 0 to a confidence of at most 1,
        and at least 0 flips)."""
        config = self.config
        loss = (
            judged.accuracy_loss / (judged.exact_confidence + remaining)
            if judged.exact_confidence + remaining
            else None
        )
        flips = judged.flips / (judged.tokens + remaining) if judged.tokens else None
        bound = "at least " if remaining else ""
        for figure, value, limit in (
            ("accuracy loss", loss, config.max_accuracy_loss),
            ("top-1 flip rate", flips, config.max_top1_flip),
        ):
            if limit is not None and value is not None and value > limit:
                return f"{figure} {bound}{value:.3f} > {limit:.3f}"
        return None

    def _judge(self, batch: BatchClass) -> None:
        """Ends the class's window when it is full, or, while the mode runs, as soon as
        it cannot end under budget (a mode far over budget is caught in a fraction of a
        window); switches if the window says so."""
        window = batch.window
        remaining = self.config.window - window.tokens
        if remaining > 0 and (batch.exact or self.over_budget(window, remaining) is None):
            return
        batch.last_window, batch.window = window, Judged()
        self.counters.windows += 1
        over = self.over_budget(window, max(remaining, 0))
        if not batch.exact and over is not None:
            batch.exact = True
            self.counters.switches_to_exact += 1
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
            self.counters.switches_to_approximate += 1
            logger.warning(
                "specexpert: quality: decode passes of %s sequence(s): the "
                "approximate mode is within budget over the last %d sampled "
                "tokens (accuracy loss %.3f, top-1 flip rate %.3f): running it "
                "again",
                batch.label,
                window.tokens,
                window.accuracy_loss_share,
                window.flip_rate,
            )

    # ------------------------------------------------------------ statistics

    def stats(self) -> dict:
        counters, total = self.counters, self.total
        return {
            "exact": any(c.exact for c in self.classes),
            **{
                key: getattr(self.config, key)
                for key in ("max_accuracy_loss", "max_top1_flip", "sample", "window")
            },
            "sampled_tokens": total.tokens,
            "top1_flips": total.flips,
            "accuracy_loss_sum": total.accuracy_loss,
            "exact_confidence_sum": total.exact_confidence,
            "top1_flip_rate": total.flip_rate,
            "kl_mean": counters.kl_sum / total.tokens if total.tokens else None,
            "accuracy_loss": total.accuracy_loss_share,
            **{k: v for k, v in dataclasses.asdict(counters).items() if not k.startswith("layer_")},
            "batches": {c.label: c.stats() for c in self.classes},
            "layers": {
                index: {
                    "tokens": tokens,
                    "top1_flips": counters.layer_flips[index],
                    "kl_sum": counters.layer_kl_sum[index],
                    "accuracy_loss_sum": counters.layer_accuracy_loss_sum[index],
                }
                for index, tokens in sorted(counters.layer_tokens.items())
            },
        }

    def reset_stats(self) -> None:
        self.counters, self.total = QualityCounters(), Judged()
        for batch in self.classes:
            batch.total, batch.exact_passes = Judged(), 0
