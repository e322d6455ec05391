"""What each mode of the engine is, as data: the config validates by these tables, and
the classes that implement the modes (miss policies, caches, predictors, in the layers
above) take their traits from them. A name -> class table beside each implementation
(``features.miss_policy_classes()``, ``tiers.eviction.CACHE_CLASSES``,
``predict.PREDICTOR_CLASSES``) has the same keys; a test holds the two together."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

Output = Literal["exact", "equivalent", "approximate"]

MissPolicyName = Literal[
    "fetch",
    "stream",
    "speculate",
    "cpu",
    "auto",
    "auto_buddy",
    "buddy",
    "random",
    "drop",
    "lowbit",
]
"""The names of :data:`MISS_POLICIES`, in its order, spelled out for the type checker
(which cannot evaluate ``Literal[tuple(MISS_POLICIES)]``); checked against the table at
import (:func:`_same_names`)."""
CacheName = Literal["lru", "lfu", "lrfu", "static", "markov", "plec"]
"""The names of :data:`CACHES`, in its order (as :data:`MissPolicyName`)."""
PredictorName = Literal["none", "router", "quasi_hidden", "estimator", "hybrid"]
"""The names of :data:`PREDICTORS`, in its order (as :data:`MissPolicyName`)."""

MESH_OUTPUT: dict[str, Output] = {
    "sync": "equivalent",
    "early_fire": "equivalent",
    "no_stop": "approximate",
}
"""What each ``mesh.mode`` does to the output: a peer's results are added to the
device's apart (equivalent); ``no_stop`` runs predicted experts on a predicted input."""


def worse_output(first: Output, second: Output | None) -> Output:
    """The output of two mechanisms together: the further from exact of the two."""
    order: tuple[Output, ...] = ("exact", "equivalent", "approximate")
    return first if second is None else order[max(order.index(first), order.index(second))]


@dataclass(frozen=True)
class MissPolicySpec:
    """Traits of a miss policy (``miss_policy``)."""

    name: str
    output: Output
    """What the policy does to the model's output: ``exact`` (bit-identical to vanilla
    vLLM), ``equivalent`` (the same experts and weights, summed in another order: equal
    up to rounding) or ``approximate`` (other experts or weights run: the output
    changes)."""
    needs_predictor: bool = False
    """Whether it runs predictions (a ``predictor`` other than ``none`` is required)."""
    speculates: bool = False
    """Whether layers run the routing predicted at the previous layer instead of the
    router's (then every predicted expert is prefetched)."""
    computes_on_host: bool = False
    """Whether it computes experts on the host (each layer needs a host kernel)."""
    substitutes: bool = False
    """Whether it substitutes resident experts for missing ones behind BuddyMoE's gates."""
    uses_buddy_lists: bool = False
    """Whether substitutes come from co-activation buddy lists (else: any resident)."""
    waits_for_copies: bool = True
    """Whether an expert still being copied counts as resident (the call waits for it).
    Policies that can compute it on the host instead treat it as missing."""
    low_bit: bool = False
    """Whether missing experts run from INT4 copies made at load (HOBBIT), moved packed
    into a small pool of the layer's slots."""
    splits_tokens: bool = False
    """Whether a call whose distinct experts do not fit in the pool may run a token's
    experts in different launches, so that each missing expert is read once per call
    (else the call runs in groups of whole tokens, and an expert needed by tokens of
    several groups is read once per group)."""

    @property
    def computes_elsewhere(self) -> bool:
        """Whether missed experts can run without loading them (on the host, or from
        INT4 copies): ``admit_host_experts`` then loads them in the background."""
        return self.computes_on_host or self.low_bit


MISS_POLICIES: dict[str, MissPolicySpec] = {
    spec.name: spec
    for spec in (
        MissPolicySpec("fetch", "exact"),
        # A split token's partial sums are each rounded to bf16 by the kernel, then added.
        MissPolicySpec("stream", "equivalent", splits_tokens=True),
        MissPolicySpec("speculate", "approximate", needs_predictor=True, speculates=True),
        # vLLM's kernel rounds each launch's sum to bf16: the device's and the host's partial
        # sums are rounded before they are added.
        MissPolicySpec("cpu", "equivalent", computes_on_host=True, waits_for_copies=False),
        MissPolicySpec("auto", "equivalent", computes_on_host=True, waits_for_copies=False),
        MissPolicySpec(
            "auto_buddy",
            "approximate",
            computes_on_host=True,
            waits_for_copies=False,
            substitutes=True,
            uses_buddy_lists=True,
        ),
        MissPolicySpec("buddy", "approximate", substitutes=True, uses_buddy_lists=True),
        MissPolicySpec("random", "approximate", substitutes=True),
        MissPolicySpec("drop", "approximate"),
        # An INT4 copy (group-wise round-to-nearest) runs instead of the expert: the output
        # changes.
        MissPolicySpec("lowbit", "approximate", waits_for_copies=False, low_bit=True),
    )
}


@dataclass(frozen=True)
class CacheSpec:
    """Traits of a device-cache policy (``cache``)."""

    name: str
    shared_pool: bool = False
    """Every layer's slots in one pool, going to whichever layer the predicted demand
    of the step wants (else a fixed count per layer)."""
    needs_path_predictor: bool = False
    """Whether it plans by the step's predicted demand (``path_predictor``)."""
    learns_routes: bool = False
    """Whether it is handed each decode call's routes
    (:meth:`~vllm_specexpert.tiers.eviction.EvictionPolicy.on_routes`)."""


CACHES: dict[str, CacheSpec] = {
    spec.name: spec
    for spec in (
        CacheSpec("lru"),
        CacheSpec("lfu"),
        CacheSpec("lrfu"),
        CacheSpec("static"),
        CacheSpec("markov", learns_routes=True),
        CacheSpec("plec", shared_pool=True, needs_path_predictor=True),
    )
}


@dataclass(frozen=True)
class PredictorSpec:
    """Traits of a next-layer predictor (``predictor``)."""

    name: str
    predicts: bool = True
    """``False`` for ``none``: nothing is predicted or prefetched."""
    needs_calibration: bool = False
    """Whether it reads the calibration's default vectors."""
    needs_estimator: bool = False
    """Whether it runs the neural expert estimator (``estimator``)."""
    needs_analysis: bool = False
    """Whether it chooses its layers by ``specexpert analyze``'s recall (``analysis``)."""


PREDICTORS: dict[str, PredictorSpec] = {
    spec.name: spec
    for spec in (
        PredictorSpec("none", predicts=False),
        PredictorSpec("router"),
        PredictorSpec("quasi_hidden", needs_calibration=True),
        PredictorSpec("estimator", needs_calibration=True, needs_estimator=True),
        PredictorSpec("hybrid", needs_calibration=True, needs_estimator=True, needs_analysis=True),
    )
}


def _same_names(alias: object, table: Mapping[str, object], name: str) -> None:
    """``alias`` (a ``Literal`` of names) lists the keys of ``table`` in their order: the
    config's field accepts exactly the table's modes, and its errors list them in order."""
    if get_args(alias) != tuple(table):
        raise AssertionError(f"{name} lists {get_args(alias)}, the table has {tuple(table)}")


_same_names(MissPolicyName, MISS_POLICIES, "MissPolicyName")
_same_names(CacheName, CACHES, "CacheName")
_same_names(PredictorName, PREDICTORS, "PredictorName")
