"""``quasi_hidden``: the quasi-hidden state of speculating-experts §3.2,

    q_l = LN_{l+1}(d_l + r_l),   d_l = sum_{e in E_l} g_{l,e} d_{l,e},

where ``d_{l,e}`` is expert e's default vector (its mean output over calibration tokens
routed to it, see :mod:`vllm_specexpert.calibrate`) and ``r_l`` the post-attention
residual. ``d_l + r_l`` stands in for layer l's output hidden state; the next layer's
attention is skipped.
"""

from __future__ import annotations

import torch

from vllm_specexpert.predict.base import LayerState, NextLayerRouting, Predictor


class QuasiHiddenPredictor(Predictor):
    name = "quasi_hidden"
    needs_residual = True

    def __init__(self, default_vectors: dict[str, torch.Tensor]):
        self.default_vectors = {name: v.float() for name, v in default_vectors.items()}
        """Layer name -> ``[E, H]`` float32 default vectors (on the compute device)."""

    def next_router_input(self, state: LayerState, layer: str, nxt: NextLayerRouting) -> torch.Tensor:
        if state.residual is None:
            raise RuntimeError(f"{layer}: the quasi_hidden predictor needs the residual r_l")
        tokens, top_k = state.topk_ids.shape
        chosen = self.default_vectors[layer].index_select(0, state.topk_ids.reshape(-1))
        d = torch.bmm(state.topk_weights.float().unsqueeze(1), chosen.view(tokens, top_k, -1))
        return nxt.norm(d.squeeze(1).add_(state.residual.float())).to(state.residual.dtype)
