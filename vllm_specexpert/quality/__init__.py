"""The quality budget (``quality``): shadow-exact sampling of decode tokens, the
estimated accuracy loss, top-1 flip rate and KL of their final logits, and the switch to
exact, per decode batch size, while over budget.

Sampled decode tokens are also computed the other way (exact while the mode runs, the
mode's while running exactly) at every MoE layer; per token the per-layer differences
``d_l`` are summed onto the served final hidden state (a first-order estimate) and the
two results' logits compared through the model's own final norm and LM head. A token's
accuracy loss is ``p[a_exact] - p[a_approx]``. Per batch class, a window of
``quality.window`` sampled tokens over budget switches that class to exact; one under
budget switches it back. Details: docs/design.md, "The quality budget".

:mod:`.logits` (the head, comparing logits), :mod:`.budget` (figures per batch class,
windows, switches), :mod:`.monitor` (sampled rows and their differences); the shadow
computations run in :mod:`vllm_specexpert.features.quality`.
"""

from vllm_specexpert.quality.budget import BatchClass, Budget, Judged, batch_classes
from vllm_specexpert.quality.logits import LogitHead, compare, kl_divergence
from vllm_specexpert.quality.monitor import QualityMonitor

__all__ = [
    "BatchClass",
    "Budget",
    "Judged",
    "LogitHead",
    "QualityMonitor",
    "batch_classes",
    "compare",
    "kl_divergence",
]
