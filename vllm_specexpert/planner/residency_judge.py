"""Whether a residency that predicts keeps its prediction, judged by bytes: each layer's
decode calls replayed, as they come, through two ghost residencies of its slots, one
kept by the prediction's order and one by plain frequency's (``lrfu``'s decayed uses);
the cache keeps by the prediction only while its ghost loaded fewer experts over the
recent calls of the batch-size bucket (issue 76).

A counterfactual replay, not an alternation: nothing is paid to find out and no clock is
read, so the judgment holds from the first call. At the first call neither ghost has
loaded anything, so the cache starts on plain frequency: a prediction is on only once it
has read fewer bytes. Ghosts hold ids only, no bytes. They model one launch over the
call's distinct experts, each missing one loaded once, the lowest kept first to go;
where the real call runs token groups or shares a region's rows, both ghosts leave that
out alike, so the comparison is like for like. Every expert of a layer is one size, so
loads compare as bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_specexpert.planner.measured import bucket
from vllm_specexpert.stats import Counters, counter

JUDGE_HALF_LIFE = 32.0
"""Decode calls of a bucket after which a ghost's load counts half: the prediction is
judged on about the last hundred steps, so a change of workload turns it off or on."""


@dataclass
class ResidencyJudgeCounters(Counters):
    """The judge of one layer (beside the engine's counters while ``cache: markov`` runs)."""

    calls_predicted: int = counter(
        "Decode calls whose evictions kept by the residency's prediction (its ghost had "
        "loaded fewer experts than plain frequency's over the bucket's recent calls)."
    )
    calls_plain: int = counter(
        "Decode calls whose evictions kept by plain frequency (lrfu's decayed uses): "
        "the prediction did not read fewer bytes, so it was off."
    )
    ghost_loads_predicted: int = counter(
        "Experts the ghost residency kept by the prediction would have loaded."
    )
    ghost_loads_plain: int = counter(
        "Experts the ghost residency kept by plain frequency would have loaded."
    )


class GhostResidency:
    """Which experts a layer's ``num_slots`` slots would hold under one order, starting
    from the engine's warm start (the first ``num_slots`` experts)."""

    def __init__(self, num_experts: int, num_slots: int) -> None:
        self.num_slots = num_slots
        self.resident = np.zeros(num_experts, dtype=bool)
        self.resident[:num_slots] = True

    def serve(self, needed: np.ndarray, keep: np.ndarray) -> int:
        """The call's experts (``needed``, ``bool [E]``) made resident, the lowest
        ``keep`` going first (the call's own last); returns how many were loaded."""
        loads = int(np.count_nonzero(needed & ~self.resident))
        held = np.flatnonzero(self.resident | needed)
        over = len(held) - self.num_slots
        if over > 0:
            # lexsort: last key is primary -> not needed first, then the lowest keep.
            going = held[np.lexsort((keep[held], needed[held]))[:over]]
            self.resident[held] = True
            self.resident[going] = False
        else:
            self.resident[held] = True
        return loads


class ResidencyJudge:
    """The judgment of one layer (module doc)."""

    def __init__(self, num_experts: int, num_slots: int) -> None:
        self.predicted = GhostResidency(num_experts, num_slots)
        self.plain = GhostResidency(num_experts, num_slots)
        self.recent: dict[int, np.ndarray] = {}
        """Batch bucket -> decayed ghost loads, ``[predicted, plain]``."""
        self._decay = float(np.exp2(-1.0 / JUDGE_HALF_LIFE))

    def serve(
        self,
        needed: np.ndarray,
        predicted_keep: np.ndarray,
        plain_keep: np.ndarray,
        batch: int,
        counters: ResidencyJudgeCounters,
    ) -> bool:
        """A decode call of ``batch`` sequences needs ``needed`` (``bool [E]``): both
        ghosts serve it by their orders (``[E]``, the higher the later to go). Returns
        whether this call's evictions keep by the prediction."""
        loads = np.array(
            [self.predicted.serve(needed, predicted_keep), self.plain.serve(needed, plain_keep)],
            dtype=np.float64,
        )
        recent = self.recent.setdefault(bucket(batch), np.zeros(2))
        recent *= self._decay
        recent += loads
        predicting = bool(recent[0] <= recent[1])
        counters.ghost_loads_predicted += int(loads[0])
        counters.ghost_loads_plain += int(loads[1])
        if predicting:
            counters.calls_predicted += 1
        else:
            counters.calls_plain += 1
        return predicting
