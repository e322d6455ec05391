"""What one layer's call runs with besides its cache: the link's cost of an expert (what
a policy may consult) and the layer's places (:mod:`vllm_specexpert.places`, each a
feature's, where the executor runs a plan's entries)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vllm_specexpert.places import Places


@dataclass
class MissContext:
    """What one layer's call runs with, besides its cache."""

    expert_copy_seconds: Callable[[], float]
    """Expected link seconds of one expert, asked when needed (the estimate may change)."""
    places: Places
    """Where the layer's entries can run besides its slots (a policy was given those it
    uses when it was built: :meth:`MissPolicy.for_layer`)."""
    admit_host_experts: bool = False
    """Load the most-used expert computed elsewhere (a place that ``admits``) in the
    background on an idle link."""

    @property
    def copy_seconds(self) -> float:
        return self.expert_copy_seconds()
