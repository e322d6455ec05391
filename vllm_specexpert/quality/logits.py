"""The model's final norm and LM head as tensors, and what two results' logits differ by:
top-1 token, KL divergence, and the accuracy the approximate one would lose."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def compare(
    exact: torch.Tensor, approx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of two results' logits: whether the top-1 token differs, KL(exact ||
    approximate), the accuracy loss ``p[exact top-1] - p[approximate top-1]`` and
    ``p[exact top-1]`` (``p``: the exact result's probabilities)."""
    exact_top1, approx_top1 = exact.argmax(-1, keepdim=True), approx.argmax(-1, keepdim=True)
    probs = exact.softmax(-1)
    confidence = probs.gather(-1, exact_top1).squeeze(-1)
    loss = confidence - probs.gather(-1, approx_top1).squeeze(-1)
    return (exact_top1 != approx_top1).squeeze(-1), kl_divergence(exact, approx), loss, confidence
