"""``router``: run layer l+1's router on layer l's router input ``s_l`` (the baseline of
speculating-experts §3.3; also Eliseev et al.'s next-gate-on-current-state)."""

from __future__ import annotations

import torch

from vllm_specexpert.predict.base import (
    FusedRouting,
    LayerState,
    NextLayerRouting,
    Predictor,
)


class RouterPredictor(Predictor):
    name = "router"

    def next_router_input(
        self, state: LayerState, layer: str, nxt: NextLayerRouting
    ) -> torch.Tensor:
        return state.router_input

    def fused_terms(self, state: LayerState, layer: str, fused: FusedRouting) -> None:
        return None
