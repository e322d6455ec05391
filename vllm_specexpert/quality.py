"""The quality budget (``quality``): shadow-exact sampling of decode tokens, the top-1
flip rate and KL of their final logits, and the switch to exact while over budget.

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

Decisions are per window of ``quality.window`` sampled tokens: over budget, the whole
engine runs exactly (``fetch``, no speculation) from the next pass on; a later window
under budget switches it back. Each switch is logged once.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_specexpert import execute
from vllm_specexpert.config.sections import QualityConfig
from vllm_specexpert.execute import LayerCall
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.log import init_logger
from vllm_specexpert.policy import MissPolicy
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
            final_hidden.float(), (final_hidden.shape[-1],), self.norm_weight.float(),
            self.eps)
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

    sampled_tokens: int = 0
    top1_flips: int = 0
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


class QualityMonitor:
    """One engine's quality budget (see module doc)."""

    def __init__(self, config: QualityConfig, head: LogitHead, first_layer: int):
        self.config = config
        self.head = head
        self.first_layer = first_layer
        """The index of the first MoE layer: its decode call starts a pass."""
        self.rng = np.random.default_rng(config.seed)
        self.exact = False
        """Whether the engine runs exactly because a window was over budget."""
        self.counters = QualityCounters()
        self.window_tokens = 0
        self.window_flips = 0
        self.last_window_flip_rate: float | None = None
        self.rows: np.ndarray | None = None
        """The running pass's sampled rows (of its decode tokens); ``None``: none."""
        self.num_rows = 0
        self.deltas: dict[int, torch.Tensor] = {}
        """Per layer index: ``other - served`` of the sampled rows ``[R, H]``."""
        self.scratch = PhaseStats()
        """Counters of the shadow computations (kept apart from the mode's)."""

    @classmethod
    def of(cls, config: QualityConfig | None, head: LogitHead | None,
           layers: dict[str, OffloadedLayer]) -> QualityMonitor | None:
        """The monitor of ``config`` (``None`` without a budget, or before the model's
        head is known)."""
        if config is None or head is None or not layers:
            return None
        return cls(config, head, min(layer.index for layer in layers.values()))

    # ------------------------------------------------------------ per layer call

    def sampled_rows(self, layer_index: int, num_rows: int) -> np.ndarray | None:
        """The rows of a decode call to recompute (drawn at the first MoE layer)."""
        if layer_index == self.first_layer:
            self.deltas = {}
            self.num_rows = num_rows
            drawn = np.flatnonzero(self.rng.random(num_rows) < self.config.sample)
            self.rows = drawn if len(drawn) else None
            if self.exact:
                self.counters.exact_passes += 1
        elif num_rows != self.num_rows:
            self.rows = None  # not the pass the rows were drawn for
        return self.rows

    def resolve(self, layer: OffloadedLayer, approx: LayerCall, router_weights: torch.Tensor,
                router_ids: np.ndarray, policy: MissPolicy) -> torch.Tensor:
        """The served output of a decode call: ``approx`` under ``policy`` (the mode),
        or the call on the router's routing with every missing expert fetched while over
        budget; the other one is computed for the sampled rows beside it."""
        rows = self.sampled_rows(layer.index, approx.x.shape[0])
        if rows is None and not self.exact:  # the common case: nothing more to do
            return execute.resolve(layer.loader, approx, policy, layer.miss_context)
        exact = approx.routed(router_weights, router_ids)
        shadow = None
        if self.exact:  # the exact call starts the next layer's prefetch
            exact.before_kernel, approx.before_kernel = approx.before_kernel, None
            if rows is not None:  # before the exact call loads what the mode would miss
                started = time.perf_counter()
                shadow = execute.resolve(layer.loader, self._quiet(approx), policy,
                                         layer.miss_context)[upload(rows, approx.x.device)]
                self._charge(started)
            out = execute.run(layer.loader, exact, execute.survey(layer.loader, exact))
        else:
            out = execute.resolve(layer.loader, approx, policy, layer.miss_context)
            if rows is not None:  # ``exact`` shares ``before_kernel``: _quiet drops it
                started = time.perf_counter()
                shadow = execute.run_on_device(layer.loader, self._quiet(exact.rows(rows)))
                self._charge(started)
        if shadow is not None:
            self.deltas[layer.index] = (shadow.float() - out[upload(rows, out.device)].float())
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
        rows, self.rows = self.rows, None
        served = final_hidden.float()
        served_logits = self.head.logits(served)
        other = served + sum(self.deltas.values())
        flips, kl = self._compare(served_logits, self.head.logits(other))
        counters = self.counters
        counters.sampled_tokens += len(rows)
        counters.top1_flips += int(flips.sum())
        counters.kl_sum += float(kl.sum())
        for index, delta in self.deltas.items():
            changed = delta.abs().amax(-1) > 0
            if not bool(changed.any()):
                continue
            layer_flips, layer_kl = self._compare(
                served_logits[changed], self.head.logits(served[changed] + delta[changed]))
            counters.layer_tokens[index] = counters.layer_tokens.get(index, 0) + int(
                changed.sum())
            counters.layer_flips[index] = counters.layer_flips.get(index, 0) + int(
                layer_flips.sum())
            counters.layer_kl_sum[index] = counters.layer_kl_sum.get(index, 0.0) + float(
                layer_kl.sum())
        self.deltas = {}
        counters.shadow_s += time.perf_counter() - started
        self._count_window(len(rows), int(flips.sum()))

    def _compare(self, served: torch.Tensor, other: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: whether the top-1 token differs, and KL(exact || approximate)."""
        exact, approx = (served, other) if self.exact else (other, served)
        return exact.argmax(-1) != approx.argmax(-1), kl_divergence(exact, approx)

    def _count_window(self, tokens: int, flips: int) -> None:
        self.window_tokens += tokens
        self.window_flips += flips
        if self.window_tokens < self.config.window:
            return
        rate = self.window_flips / self.window_tokens
        self.last_window_flip_rate = rate
        self.counters.windows += 1
        budget = self.config.max_top1_flip
        if not self.exact and rate > budget:
            self.exact = True
            self.counters.switches_to_exact += 1
            logger.warning("specexpert: quality: top-1 flip rate %.3f over the last %d "
                           "sampled tokens exceeds max_top1_flip %.3f: running exactly "
                           "(fetch) until a window is under budget", rate,
                           self.window_tokens, budget)
        elif self.exact and rate <= budget:
            self.exact = False
            self.counters.switches_to_approximate += 1
            logger.warning("specexpert: quality: the approximate mode's top-1 flip rate "
                           "%.3f over the last %d sampled tokens is within max_top1_flip "
                           "%.3f: running it again", rate, self.window_tokens, budget)
        self.window_tokens = self.window_flips = 0

    # ------------------------------------------------------------ statistics

    def stats(self) -> dict:
        counters = self.counters
        sampled = counters.sampled_tokens
        return {
            "exact": self.exact,
            "max_top1_flip": self.config.max_top1_flip,
            "sample": self.config.sample,
            "window": self.config.window,
            "top1_flip_rate": counters.top1_flips / sampled if sampled else None,
            "kl_mean": counters.kl_sum / sampled if sampled else None,
            "last_window_flip_rate": self.last_window_flip_rate,
            **{k: v for k, v in dataclasses.asdict(counters).items()
               if not k.startswith("layer_")},
            "layers": {index: {"tokens": tokens, "top1_flips": counters.layer_flips[index],
                               "kl_sum": counters.layer_kl_sum[index]}
                       for index, tokens in sorted(counters.layer_tokens.items())},
        }

    def reset_stats(self) -> None:
        self.counters = QualityCounters()
