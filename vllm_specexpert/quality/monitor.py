"""The quality monitor: which decode rows of a pass are sampled, what the other result
differs by at each MoE layer for them, and their comparison at the final norm, judged
by the budget (:mod:`.budget`). See :mod:`vllm_specexpert.quality`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_specexpert.config.sections import QualityConfig
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.quality.budget import Budget, Judged
from vllm_specexpert.quality.logits import LogitHead, compare
from vllm_specexpert.stats import Counters, PhaseStats, counter, seconds


@dataclass
class QualityCounters(Counters):
    """What the monitor measured since the last reset."""

    kl_sum: float = counter(
        "Sum over sampled tokens of KL(exact || approximate) of the final logits, nats."
    )
    exact_passes: int = counter("Decode passes run exactly because of the budget.")
    shadow_calls: int = counter("Layer calls recomputed beside the served result.")
    shadow_s: float = seconds("Wall time of the shadow computations and the logit comparisons.")
    shadow_bytes: int = counter(
        "Bytes the shadow computations loaded (exact rows' missing experts, or the "
        "mode's own loads while the engine runs exactly)."
    )
    layer_tokens: dict[int, int] = field(default_factory=dict)
    """Per MoE layer index: sampled tokens whose result that layer changed."""
    layer_flips: dict[int, int] = field(default_factory=dict)
    layer_kl_sum: dict[int, float] = field(default_factory=dict)
    layer_accuracy_loss_sum: dict[int, float] = field(default_factory=dict)


class QualityMonitor:
    """One engine's quality budget (see module doc)."""

    def __init__(self, config: QualityConfig, head: LogitHead, first_layer: int) -> None:
        self.config = config
        self.head = head
        self.first_layer = first_layer
        """The index of the first MoE layer: its decode call starts a pass."""
        self.rng = np.random.default_rng(config.seed)
        self.budget = Budget(config)
        self.counters = QualityCounters()
        self.total = Judged()
        """Every sampled token since the last reset."""
        self.pass_class = self.budget.classes[0]
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

    def exact_for(self, num_rows: int) -> bool:
        """Whether a decode pass of ``num_rows`` sequences runs exactly (over budget)."""
        return self.budget.exact_for(num_rows)

    # ------------------------------------------------------------ per layer call

    def sampled_rows(self, layer_index: int, num_rows: int) -> np.ndarray | None:
        """The rows of a decode call to recompute (drawn at the first MoE layer)."""
        if layer_index == self.first_layer:
            self.deltas = {}
            self.num_rows = num_rows
            self.pass_class = self.budget.class_of(num_rows)
            drawn = np.flatnonzero(self.rng.random(num_rows) < self.config.sample)
            self.rows = drawn if len(drawn) else None
            if self.pass_class.exact:
                self.counters.exact_passes += 1
                self.pass_class.exact_passes += 1
        elif num_rows != self.num_rows:
            self.rows = None  # not the pass the rows were drawn for
        return self.rows

    def shadowed(self, layer_index: int, other: torch.Tensor, served: torch.Tensor) -> None:
        """Layer ``layer_index``'s other result of the sampled rows, beside the served."""
        self.deltas[layer_index] = other.float() - served.float()

    def charge(self, started: float) -> None:
        """A shadow computation that started at ``started`` (``perf_counter``) is done:
        its time and the bytes it loaded (:attr:`scratch`) are the monitor's cost."""
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
        sums = torch.stack(  # one device read
            [
                flips.sum().float(),
                kl.sum(),
                loss.sum(),
                confidence.sum(),
                loss.square().sum(),
                confidence.square().sum(),
                (loss * confidence).sum(),
            ]
        ).tolist()
        flip_count, kl_sum, *figures = sums
        counters.kl_sum += kl_sum
        judged = Judged(len(flips), int(flip_count), *figures)
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
        self.budget.judge(self.pass_class)

    def _compare(self, served: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """:func:`compare` with the exact result first: the other one while the mode is
        served, the served one while its class runs exactly."""
        return compare(served, other) if self.pass_class.exact else compare(other, served)

    # ------------------------------------------------------------ statistics

    def stats(self) -> dict:
        counters, total = self.counters, self.total
        classes = self.budget.classes
        sampled = [c for c in classes if c.window.tokens or c.judged]
        return {
            "exact": any(c.exact for c in classes),
            "judged": bool(sampled) and all(c.judged for c in sampled),
            **{
                key: getattr(self.config, key)
                for key in ("max_accuracy_loss", "max_top1_flip", "sample", "window", "confidence")
            },
            "sampled_tokens": total.tokens,
            "top1_flips": total.flips,
            "accuracy_loss_sum": total.accuracy_loss,
            "exact_confidence_sum": total.exact_confidence,
            "top1_flip_rate": total.flip_rate,
            "kl_mean": counters.kl_sum / total.tokens if total.tokens else None,
            "accuracy_loss": total.accuracy_loss_share,
            **counters.counts(),
            **self.budget.stats(),
            "batches": {c.label: c.stats(self.budget.z) for c in classes},
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
        self.budget.reset_stats()
