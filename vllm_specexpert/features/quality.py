"""The quality budget as an engine feature: while a decode batch class is over budget its
calls run exactly, and a sampled share of tokens is recomputed beside the served result
(the shadow computation, here) for the monitor to compare at the final norm
(:class:`~vllm_specexpert.quality.QualityMonitor`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.layer_call import NOTHING_FIRST, LayerCall
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.pipeline import DecodeCall, ExactDemand, Part, Runner, RunWrap
from vllm_specexpert.quality import QualityMonitor
from vllm_specexpert.stats import Series, metric_name
from vllm_specexpert.tiers.staging import upload


class ShadowedRun(Runner):
    """The quality budget's wrap of a layer's run step (``mode``; ``exact``: the exact
    runner): the served output is the mode's, or, while the call's batch class is over
    budget, the exact runner's on the router's routing; the other one is computed for
    the sampled rows beside it."""

    def __init__(self, monitor: QualityMonitor, mode: Runner, exact: Runner) -> None:
        self.monitor, self.mode, self.exact = monitor, mode, exact

    def run(self, call: DecodeCall | None, run: LayerCall) -> torch.Tensor:
        assert call is not None  # (a wrapper sees decode calls)
        monitor, mode, exact, layer = self.monitor, self.mode, self.exact, call.layer
        rows = monitor.sampled_rows(layer.index, call.num_tokens)
        over_budget = monitor.exact_for(call.num_tokens)
        if rows is None and not over_budget:  # the common case: nothing more to do
            return mode.run(call, run)
        routed = run.routed(call.router_weights, call.router_host_ids)
        shadow = None
        started = time.perf_counter()
        if over_budget:  # the exact call starts the next layer's prefetch (``routed``'s)
            if rows is not None:  # before the exact call loads what the mode would miss
                shadow = mode.run(call, self._quiet(run))[upload(rows, run.x.device)]
                monitor.charge(started)
            out = exact.run(call, routed)
        else:
            out = mode.run(call, run)
            if rows is not None:  # (the shadow starts nothing: _quiet)
                started = time.perf_counter()
                shadow = exact.run(call, self._quiet(routed.rows(rows)))
                monitor.charge(started)
        if shadow is not None:
            assert rows is not None  # (a shadow is computed for sampled rows only)
            monitor.shadowed(layer.index, shadow, out[upload(rows, out.device)])
        return out

    def _quiet(self, run: LayerCall) -> LayerCall:
        """``run`` counted apart from the mode's counters and starting no prefetch: a
        shadow computation (the exact one loads on the device; the mode's takes what
        its places computed, a mesh's peers among them), into a buffer of its own."""
        return dataclasses.replace(
            run, stats=self.monitor.scratch, first_launch=NOTHING_FIRST, out=None
        )


class QualityFeature(EngineFeature):
    name = "quality"
    inputs = ("logit_head",)

    def __init__(self, monitor: QualityMonitor):
        self.monitor = monitor

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        if parts.output != "approximate":
            return None  # (the budget waits for a mode that changes the output)
        monitor = QualityMonitor.of(parts.config.quality, inputs.get("logit_head"), parts.layers)
        return cls(monitor) if monitor is not None else None

    @classmethod
    def check(cls, parts: EngineParts, inputs: Inputs) -> None:
        config = parts.config
        budgeted = config.output == "approximate" and config.quality is not None
        if budgeted and inputs.get("logit_head") is None:
            raise SpecExpertConfigError(
                "quality",
                "a mode that changes the output runs under the quality budget, whose "
                "monitor reads the model's final norm through a tap installed at engine "
                "start, and this engine has none (it started with quality null, or its "
                "model has no final RMS norm and LM head as model.norm and lm_head)",
                "start the engine without 'quality': null, or set quality to null "
                "to run the mode without a budget",
            )

    def summary(self) -> str:
        settings = self.monitor.config
        limits = [
            f"{settings.max_accuracy_loss:.0%} of next-token accuracy lost"
            if settings.max_accuracy_loss is not None
            else "",
            f"{settings.max_top1_flip:.0%} of top-1 tokens flipped"
            if settings.max_top1_flip is not None
            else "",
        ]
        bound = f" (one-sided {settings.confidence:.0%} bound)" if settings.confidence > 0.5 else ""
        return (
            f"; quality budget: at most {' or '.join(filter(None, limits))}{bound} over "
            f"{settings.window} sampled tokens ({settings.sample:.0%} of decode tokens "
            "recomputed exactly; exact while over)"
        )

    def stages(self, layer: OffloadedLayer) -> Sequence[Part]:
        return (
            ExactDemand("quality.over_budget", self.monitor.exact_for),
            RunWrap("quality.shadow", lambda mode, exact: ShadowedRun(self.monitor, mode, exact)),
        )

    def stats(self) -> dict:
        return self.monitor.stats()

    def reset_stats(self) -> None:
        self.monitor.reset_stats()

    def series(self) -> list[Series]:
        """``specexpert_quality_*``: per batch class (label ``batch``) its state and last
        window, the monitor's :data:`QUALITY_COUNTERS`, its switches, per MoE layer its
        flips and tokens."""
        stats = self.monitor.stats()
        batch = ("batch",)
        exact = Series(
            "quality_exact",
            "gauge",
            "1 while the decode passes of this batch class run exactly because the quality "
            "budget was exceeded.",
            batch,
        )
        judged = Series(
            "quality_judged",
            "gauge",
            "1 once a window of this batch class has ended; 0 while its sampled tokens are "
            "fewer than quality.window and the budget has not judged it yet.",
            batch,
        )
        window_tokens = Series(
            "quality_window_sampled_tokens",
            "gauge",
            "Sampled tokens of the batch class's running window (it ends at quality.window).",
            batch,
        )
        windows = {
            "last_window_accuracy_loss": Series(
                "quality_window_accuracy_loss",
                "gauge",
                "Estimated accuracy loss of the batch class's last completed window.",
                batch,
            ),
            "last_window_flip_rate": Series(
                "quality_window_flip_rate",
                "gauge",
                "Top-1 flip rate of the batch class's last completed window.",
                batch,
            ),
            "last_window_accuracy_loss_bound": Series(
                "quality_window_accuracy_loss_bound",
                "gauge",
                "One-sided upper bound at quality.confidence of the last completed "
                "window's accuracy loss: what the budget judged.",
                batch,
            ),
            "last_window_flip_rate_bound": Series(
                "quality_window_flip_rate_bound",
                "gauge",
                "One-sided upper bound at quality.confidence of the last completed "
                "window's top-1 flip rate: what the budget judged.",
                batch,
            ),
        }
        for label, state in stats["batches"].items():
            exact.add(state["exact"], label)
            judged.add(state["judged"], label)
            window_tokens.add(state["window_tokens"], label)
            for key, family in windows.items():
                if state[key] is not None:
                    family.add(state[key], label)
        switches = Series(
            "quality_switches", "counter", "Switches to the exact policy and back.", ("to",)
        )
        switches.add(stats["switches_to_exact"], "exact")
        switches.add(stats["switches_to_approximate"], "approximate")
        layer = ("layer",)
        flips = Series(
            "quality_layer_top1_flips",
            "counter",
            "Sampled tokens whose top-1 token that layer's difference alone flips.",
            layer,
        )
        tokens = Series(
            "quality_layer_tokens",
            "counter",
            "Sampled tokens whose result that layer changed.",
            layer,
        )
        for index, counted in stats["layers"].items():
            flips.add(counted["top1_flips"], index)
            tokens.add(counted["tokens"], index)
        return [
            exact,
            judged,
            window_tokens,
            *windows.values(),
            *(
                Series(f"quality_{metric_name(key)}", "counter", doc).add(stats[key])
                for key, doc in QUALITY_COUNTERS.items()
            ),
            switches,
            flips,
            tokens,
        ]


QUALITY_COUNTERS = {
    "sampled_tokens": "Decode tokens recomputed exactly beside the served result.",
    "top1_flips": "Sampled tokens whose exact and approximate top-1 token differ.",
    "kl_sum": "Sum over sampled tokens of KL(exact || approximate) of the final logits, nats.",
    "accuracy_loss_sum": "Sum over sampled tokens of p[exact top-1] - p[approximate "
    "top-1], p the exact next-token probabilities.",
    "exact_confidence_sum": "Sum over sampled tokens of p[exact top-1] (the accuracy "
    "loss's denominator).",
    "exact_passes": "Decode passes run exactly because of the budget.",
    "shadow_s": "Seconds spent on the shadow computations.",
    "shadow_bytes": "Bytes the shadow computations loaded.",
}
"""The monitor's counters on ``/metrics`` (``specexpert_quality_<key>_total``), by the
key of its stats (``QualityMonitor.stats``)."""

FEATURE = QualityFeature
