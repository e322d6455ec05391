"""Eviction policies of the device cache: which resident expert of a layer goes first
(``cache``: ``lru``, ``lfu``, ``lrfu``, ``static``, ``markov``; ``plec`` orders by predicted
demand in the shared pool and by ``lrfu``'s order among equals)."""

from __future__ import annotations

import numpy as np

from vllm_specexpert.config.modes import CACHES, CacheSpec


class EvictionPolicy:
    """Orders eviction candidates. Subclasses keep per-expert usage state."""

    spec: CacheSpec
    """The policy's traits (:mod:`vllm_specexpert.config.modes`)."""

    @property
    def name(self) -> str:
        return self.spec.name

    def __init__(self, num_experts: int, num_slots: int, top_k: int) -> None:
        self.last_used = np.zeros(num_experts, dtype=np.int64)
        self.uses = np.zeros(num_experts, dtype=np.int64)
        """Launches that used each expert (outside frozen recency), whatever the order."""
        self.pinned = np.zeros(num_experts, dtype=bool)
        """Experts that are never evicted once resident."""

    def on_use(self, experts: np.ndarray, clock: int, tokens: int = 1) -> None:
        """``experts`` ran in one launch of ``tokens`` tokens at ``clock``."""
        self.last_used[experts] = clock
        self.uses[experts] += 1

    def on_routes(self, ids: np.ndarray) -> None:
        """A decode call's routes (``[T, K]``, a row per decoding sequence), before its
        loads: a policy that predicts from them (``markov``) learns here."""

    def sweep_demand(self) -> np.ndarray | None:
        """What a call that streams (more distinct experts than slots) keeps for the
        next: per expert, the higher the later to go. Its own order would keep the last
        window streamed (recency), whatever the next call needs; the measured uses keep
        the experts the next call most likely needs. ``None``: the pool's order decides."""
        return self.uses

    def order(self, candidates: np.ndarray) -> np.ndarray:
        """``candidates`` sorted so that the first is evicted first."""
        raise NotImplementedError

    def keep_rank(self) -> np.ndarray:
        """Every expert's place in :meth:`order` (``[E]``: the higher, the later to go)."""
        experts = np.arange(len(self.last_used))
        rank = np.empty(len(experts))
        rank[self.order(experts)] = experts
        return rank


class LRUPolicy(EvictionPolicy):
    spec = CACHES["lru"]

    def order(self, candidates: np.ndarray) -> np.ndarray:
        return candidates[np.argsort(self.last_used[candidates], kind="stable")]


class LFUPolicy(EvictionPolicy):
    spec = CACHES["lfu"]

    def order(self, candidates: np.ndarray) -> np.ndarray:
        # lexsort: last key is primary -> fewest uses first, then least recent.
        return candidates[np.lexsort((self.last_used[candidates], self.uses[candidates]))]


LRFU_HALF_LIFE = 2.0
"""Launches a use of an expert counts half after, per token of each launch (``lrfu``):
2 launches of one token, 64 of 32. Chosen on the embedded model's recorded routes
(``benchmarks/residency_bound.py``)."""


class LRFUPolicy(EvictionPolicy):
    """``lrfu``: each expert's uses, each weighted by how long ago it was (Lee et al.'s
    LRFU): frequency and recency in one score, the lowest evicted first (ties: least
    recent). A hot expert outlives a burst of one-off ones, which LRU would keep
    instead; an expert used often long ago fades, which LFU would keep for good. A use
    halves after :data:`LRFU_HALF_LIFE` launches per token of each launch: at one
    sequence the next call needs what the last few needed (recency), and the more
    sequences share a launch the more the next one needs the experts used most
    (frequency)."""

    spec = CACHES["lrfu"]

    def __init__(self, num_experts: int, num_slots: int, top_k: int) -> None:
        super().__init__(num_experts, num_slots, top_k)
        self.age = 0.0
        """The score's clock: each launch of this layer adds 1 / its tokens (the pool's
        ticks count every layer of a shared one)."""
        self.weight = np.zeros(num_experts)
        """Each expert's decayed uses as of its own last use (:attr:`used_at`)."""
        self.used_at = np.zeros(num_experts)

    def on_use(self, experts: np.ndarray, clock: int, tokens: int = 1) -> None:
        super().on_use(experts, clock, tokens)
        self.age += 1.0 / max(tokens, 1)
        self.weight[experts] = self.score(experts) + 1.0
        self.used_at[experts] = self.age

    def score(self, experts: np.ndarray) -> np.ndarray:
        """The experts' decayed uses now."""
        return self.weight[experts] * np.exp2(-(self.age - self.used_at[experts]) / LRFU_HALF_LIFE)

    def order(self, candidates: np.ndarray) -> np.ndarray:
        # lexsort: last key is primary -> lowest score first, then least recent.
        return candidates[np.lexsort((self.last_used[candidates], self.score(candidates)))]


MARKOV_FREQUENCY_WEIGHT = 0.1
"""What one decayed use (``lrfu``'s score) weighs against a whole predicted chance of
use in the next step (``markov``). Chosen in a scratch replay of the embedded model's
recorded routes, against 0.3 and 1.0 (within 4 % of each other at 1-32 sequences; 0.1
the fewest loads at 8)."""


class MarkovPolicy(LRFUPolicy):
    """``markov``: the chance that the next decode step uses each expert, predicted from
    the routes of this one, plus :data:`MARKOV_FREQUENCY_WEIGHT` times ``lrfu``'s score;
    the lowest evicted first (ties: least recent). A sequence's next token tends to
    route where its last one did, and to a few experts that follow those: a Markov chain
    over the layer's experts, ``P(b next | a now)``, counted from the served decode
    calls (row ``r`` of one call and row ``r`` of the next, same-sized calls: vLLM keeps
    a running request's row while the batch holds). Where nothing has been counted, the
    chance is the top-k's share, so the order is ``lrfu``'s."""

    spec = CACHES["markov"]

    def __init__(self, num_experts: int, num_slots: int, top_k: int) -> None:
        super().__init__(num_experts, num_slots, top_k)
        self.followed = np.zeros((num_experts, num_experts))
        """``[a, b]``: times a row that used ``a`` used ``b`` in the next call."""
        self.seen = np.zeros(num_experts)
        """``[a]``: times a row used ``a`` in a call that a counted one followed."""
        self.prior = 1.0
        """Pseudo-counts toward the uniform chance (``top_k / E`` each)."""
        self.next_demand = np.zeros(num_experts)
        """The chance that the next call uses each expert, from the latest routes (a
        Poisson approximation of one row or more using it)."""
        self.predicting = True
        """Whether the order weighs :attr:`next_demand` (else it is ``lrfu``'s): the
        ``next_step`` feature's judge turns it off where it does not read fewer bytes
        (:mod:`vllm_specexpert.planner.bytes_judge`)."""
        self._last: np.ndarray | None = None

    def on_routes(self, ids: np.ndarray) -> None:
        last, self._last = self._last, np.array(ids, copy=True)
        experts = len(self.seen)
        if last is not None and last.shape == ids.shape:
            pairs = last[:, :, None].astype(np.int64) * experts + ids[:, None, :]
            self.followed += np.bincount(pairs.ravel(), minlength=experts**2).reshape(
                experts, experts
            )
            self.seen += np.bincount(last.ravel(), minlength=experts)
        # Each row's chance of using b next is the mean of P(b | a) over its experts a;
        # summed over rows, the expected rows using b, which needs only how many rows
        # used each a: one [E] x [E, E] product, whatever the batch.
        weight = np.bincount(ids.ravel(), minlength=experts) / (self.seen + self.prior)
        share = ids.shape[1] / experts
        expected = (weight @ self.followed + self.prior * share * weight.sum()) / ids.shape[1]
        self.next_demand = -np.expm1(-expected)  # P(some row uses it), rows independent

    def keep_score(self, experts: np.ndarray) -> np.ndarray:
        """The higher, the later to go: the predicted chance of use next step, plus the
        weighed decayed uses (only those while not :attr:`predicting`)."""
        if not self.predicting:
            return self.score(experts)
        return self.predicted_keep(experts)

    def predicted_keep(self, experts: np.ndarray) -> np.ndarray:
        """The prediction's order, whether or not it is on."""
        return self.next_demand[experts] + MARKOV_FREQUENCY_WEIGHT * self.score(experts)

    def sweep_demand(self) -> np.ndarray | None:
        return self.keep_score(np.arange(len(self.seen)))

    def order(self, candidates: np.ndarray) -> np.ndarray:
        keep = self.keep_score(candidates)
        return candidates[np.lexsort((self.last_used[candidates], keep))]


class StaticPolicy(LRUPolicy):
    """The first ``num_slots - top_k`` experts are pinned; ``top_k`` slots rotate (LRU)."""

    spec = CACHES["static"]

    def __init__(self, num_experts: int, num_slots: int, top_k: int) -> None:
        super().__init__(num_experts, num_slots, top_k)
        self.pinned[: max(num_slots - top_k, 0)] = True


class PlecPolicy(LRFUPolicy):
    """``plec``: decayed uses, then recency (``lrfu``'s order), break ties in the shared
    pool's victim order, which comes first from the predicted demand
    (:class:`~vllm_specexpert.tiers.slots.SharedSlotPool`)."""

    spec = CACHES["plec"]

    def sweep_demand(self) -> np.ndarray | None:
        return None  # (the shared pool's predicted uses: PLEC's demand for the step)


CACHE_CLASSES: dict[str, type[EvictionPolicy]] = {
    cls.spec.name: cls
    for cls in (LRUPolicy, LFUPolicy, LRFUPolicy, StaticPolicy, MarkovPolicy, PlecPolicy)
}
"""Every cache policy by its config name (``cache``)."""
