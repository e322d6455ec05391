"""The quality budget as an engine feature: while a decode batch class is over budget its
calls run exactly, and a sampled share of tokens is recomputed beside the served result
(the monitor, :class:`~vllm_specexpert.quality.QualityMonitor`)."""

from __future__ import annotations

import torch

from vllm_specexpert.features.base import DecodeCall, EngineFeature, Resolve
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.quality import QualityMonitor


class QualityFeature(EngineFeature):
    name = "quality"

    def __init__(self, monitor: QualityMonitor):
        self.monitor = monitor

    def forces_exact(self, num_tokens: int) -> bool:
        return self.monitor.exact_for(num_tokens)

    def resolve(self, call: DecodeCall, run: LayerCall, rest: Resolve) -> torch.Tensor:
        return self.monitor.resolve(
            call.layer,
            run,
            call.router_weights,
            call.router_host_ids,
            lambda mode: rest(call, mode),
        )

    def stats(self) -> dict:
        return self.monitor.stats()

    def reset_stats(self) -> None:
        self.monitor.reset_stats()
