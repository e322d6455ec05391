"""``quasi_hidden``: the quasi-hidden state of speculating-experts §3.2,

    q_l = LN_{l+1}(d_l + r_l),   d_l = sum_{e in E_l} g_{l,e} d_{l,e},

where ``d_{l,e}`` is expert e's default vector (its mean output over calibration tokens
routed to it, :mod:`vllm_specexpert.calibrate`) and ``r_l`` the post-attention residual,
recovered from the router input as ``r_l ~ s_l / w_l * rho_l`` (``rho_l``: its calibrated
mean RMS; why, and what it costs: docs/design.md, "Prediction and prefetch"). The next
layer's attention is skipped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_specexpert.predict.base import (
    FusedRouting,
    LayerState,
    NextLayerRouting,
    Predictor,
    PredictorInputs,
)

if TYPE_CHECKING:
    from vllm_specexpert.triton_kernels.predict import QuasiHiddenTerms


class QuasiHiddenPredictor(Predictor):
    name = "quasi_hidden"

    def __init__(
        self, default_vectors: dict[str, torch.Tensor], residual_scales: dict[str, torch.Tensor]
    ) -> None:
        self.default_vectors = {name: v.float() for name, v in default_vectors.items()}
        """Layer name -> ``[E, H]`` default vectors (on the compute device)."""
        self.residual_scales = {name: v.float() for name, v in residual_scales.items()}
        """Layer name -> ``[H]``: ``rho_l / w_l``, turning ``s_l`` back into ``r_l``."""

    @classmethod
    def build(cls, inputs: PredictorInputs) -> QuasiHiddenPredictor:
        return cls(inputs.default_vectors, inputs.residual_scales)

    def next_router_input(
        self, state: LayerState, layer: str, nxt: NextLayerRouting
    ) -> torch.Tensor:
        tokens, top_k = state.topk_ids.shape
        chosen = self.default_vectors[layer].index_select(0, state.topk_ids.reshape(-1))
        d = torch.bmm(state.topk_weights.float().unsqueeze(1), chosen.view(tokens, top_k, -1))
        residual = state.router_input.float() * self.residual_scales[layer]
        return nxt.norm(d.squeeze(1).add_(residual)).to(state.router_input.dtype)

    def fused_terms(self, state: LayerState, layer: str, fused: FusedRouting) -> QuasiHiddenTerms:
        from vllm_specexpert.triton_kernels.predict import QuasiHiddenTerms

        return QuasiHiddenTerms(
            state.topk_ids,
            state.topk_weights,
            self.default_vectors[layer],
            self.residual_scales[layer],
            fused.norm_weight,
            fused.eps,
        )


def residual_scale(norm_weight: torch.Tensor, residual_rms: float) -> torch.Tensor:
    """``rho_l / w_l`` for a layer whose router input is ``w_l * r_l / rms(r_l)``
    (weights of magnitude below 1e-6 are treated as 1e-6, keeping their sign)."""
    w = norm_weight.float()
    w = torch.where(w.abs() < 1e-6, torch.where(w < 0, -1e-6, 1e-6), w)
    return residual_rms / w
