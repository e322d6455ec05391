"""The quality budget (``quality``): shadow-exact sampling of decode tokens, the
estimated accuracy loss, top-1 flip rate and KL of their final logits, and the switch to
exact, per decode batch size, while over budget.

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

The accuracy loss of a sampled token is ``p[a_exact] - p[a_approx]``, ``p`` the exact
result's next-token probabilities and ``a`` the two top-1 tokens: what the approximate
token would lose in expected accuracy if the exact model were calibrated (a flip between
two near-equal tokens costs almost nothing; a flip away from a confident token costs its
confidence). A window's loss is its sum over the sum of ``p[a_exact]``, the exact
result's expected accuracy: a share, like the 98 % the approximate modes aim at.

Decode passes are judged per batch class (``quality.batch_classes``, by the number of
decode sequences), because a layer call of more tokens misses more experts. Decisions
are per window of ``quality.window`` sampled tokens of one class: over budget, passes
of that class run exactly (``fetch``, no speculation) from the next one on; a later
window under budget switches the class back. Each switch is logged once. While the mode
runs, a window that can no longer end under budget, whatever its remaining tokens, is
judged at once.

The package: :mod:`.logits` (the model's head and the comparison of two results' logits),
:mod:`.budget` (sampled tokens' figures per batch class, the windows and the switches),
:mod:`.monitor` (the sampled rows of each pass and their differences, compared at the
final norm). The shadow computations themselves run in the engine's quality feature
(:mod:`vllm_specexpert.features.quality`).
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
