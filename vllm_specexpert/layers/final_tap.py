"""``quality``: the model's final norm, wrapped so that the quality monitor sees the
served pre-norm final hidden state of the tokens it sampled.

The wrapper calls one opaque custom op, ``specexpert::final_hidden``, on the input of
the final norm (``hidden`` and the residual stream) and hands its output, a copy of
``hidden``, to the norm as before: under torch.compile the op stays out of the traced
graph, so the monitor's Python runs in every pass. It is installed at engine start
unless ``quality`` is null (the budget is on by default and an approximate mode may be
reached later by ``reconfigure``): the op takes the norm's inputs as they are and hands
back a copy, so the norm computes the same bits (checked in compiled mode by
``tests/test_exactness.py``); a model without a final RMS norm and LM head gets no tap,
and its engine refuses an approximate mode under a budget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from vllm.utils.torch_utils import direct_register_custom_op

from vllm_specexpert.features.quality import QualityFeature
from vllm_specexpert.layers.forward_phase import current_phases
from vllm_specexpert.quality import LogitHead

if TYPE_CHECKING:
    from vllm_specexpert.engine import OffloadEngine

FINAL_HIDDEN_OP = "specexpert::final_hidden"
"""The op's qualified name (a CUDA-graph splitting op, see ``validate``)."""
_TAPS: dict[str, tuple[Any, int]] = {}
"""Tap key -> the OffloadEngine whose quality monitor it feeds, and the most tokens a
decoding request is scheduled per pass."""


class FinalNormTap(nn.Module):
    """Wraps the model's final norm (see module doc)."""

    def __init__(
        self, norm: nn.Module, engine: OffloadEngine, key: str, decode_query_len: int
    ) -> None:
        super().__init__()
        self.norm = norm
        self.key = key
        _TAPS[key] = (engine, decode_query_len)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # (the norm's own result: with a residual, the normed hidden and the new residual)
        hidden = torch.ops.specexpert.final_hidden(hidden, residual, self.key)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)


def install_final_tap(model: Any, engine: Any, decode_query_len: int) -> None:
    """Wrap ``model``'s final norm and give ``engine`` the model's :class:`LogitHead`
    (nothing where the model has no final RMS norm and LM head: the engine refuses a
    budgeted approximate mode then, ``QualityFeature.check``)."""
    norm = getattr(getattr(model, "model", None), "norm", None)
    lm_head = getattr(model, "lm_head", None)
    weight = getattr(lm_head, "weight", None)
    if norm is None or weight is None or not hasattr(norm, "variance_epsilon"):
        return
    processor = getattr(model, "logits_processor", None)
    vocab_size = getattr(processor, "org_vocab_size", None) or model.config.vocab_size
    engine.provide(
        logit_head=LogitHead(
            norm_weight=norm.weight.data,
            eps=norm.variance_epsilon,
            weight=weight.data,
            vocab_size=vocab_size,
            scale=float(getattr(processor, "scale", 1.0) or 1.0),
            soft_cap=getattr(processor, "soft_cap", None),
        )
    )
    model.model.norm = FinalNormTap(norm, engine, f"{id(engine)}", decode_query_len)


def _final_hidden_impl(
    hidden: torch.Tensor, residual: torch.Tensor | None, key: str
) -> torch.Tensor:
    engine, decode_query_len = _TAPS[key]
    quality = engine.feature(QualityFeature)
    monitor = quality.monitor if quality is not None else None
    if monitor is not None and monitor.pending:
        phases = current_phases(hidden.shape[0], decode_query_len)
        decode = np.arange(hidden.shape[0]) if phases.all_decode else phases.decode
        if len(decode) == monitor.num_rows:
            tokens = torch.from_numpy(decode[monitor.rows]).to(hidden.device)
            final = hidden[tokens].float()
            if residual is not None:
                final += residual[tokens].float()
            with engine.lock:
                monitor.finish_pass(final)
    return hidden.clone()


def _final_hidden_fake(
    hidden: torch.Tensor, residual: torch.Tensor | None, key: str
) -> torch.Tensor:
    return torch.empty_like(hidden)


_LIBRARY = torch.library.Library("specexpert", "FRAGMENT")  # alive: its ops stay registered
direct_register_custom_op(
    "final_hidden",
    _final_hidden_impl,
    mutates_args=[],
    fake_impl=_final_hidden_fake,
    target_lib=_LIBRARY,
)
