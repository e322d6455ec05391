"""The clairvoyant bound of a cache on recorded routes: Belady's MIN (on a miss with the
cache full, evict the expert whose next use is furthest away) gives the fewest loads any
cache of that size could make on that sequence; LRU on the same sequence beside it.

Used by ``disk_vs_llamacpp.py``: the engine's calls are recorded (per layer, the experts
each call needs, in order, and whether it was a decode call), each layer's sequence is
replayed here at the engine's slots per layer, and the loads of the decode calls are
compared with what the engine read. A step's experts are one request each (a call loads
an expert once, however many of its tokens use it), in id order.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


def flatten(calls: Sequence[tuple[np.ndarray, bool]]) -> tuple[list[int], list[bool]]:
    """``(experts a call needs, decode?)`` per call -> one request per distinct expert of
    each call, and whether it is a decode call's."""
    sequence: list[int] = []
    decode: list[bool] = []
    for experts, is_decode in calls:
        distinct = np.unique(experts).tolist()
        sequence += distinct
        decode += [is_decode] * len(distinct)
    return sequence, decode


def flatten_pooled(
    calls: Sequence[tuple[int, np.ndarray, bool]], experts_per_layer: int
) -> tuple[list[int], list[bool]]:
    """Every layer's calls in the order they ran, ``(layer index, experts, decode?)``, as
    one sequence of (layer, expert) pairs (``layer * experts_per_layer + expert``): the
    replay of one cache that all layers' slots and a shared region make together."""
    sequence: list[int] = []
    decode: list[bool] = []
    for layer, experts, is_decode in calls:
        distinct = (np.unique(experts) + layer * experts_per_layer).tolist()
        sequence += distinct
        decode += [is_decode] * len(distinct)
    return sequence, decode


def belady_misses(
    sequence: Sequence[int], counted: Sequence[float], capacity: int, initial: Sequence[int] = ()
) -> float:
    """Misses of Belady's MIN on ``sequence`` at ``capacity``, each counted as ``counted``
    at its position (``True``/``False``: the positions counted; bytes: what each miss
    reads), the cache holding ``initial`` (at most ``capacity`` experts) at the start."""
    never = len(sequence)
    next_use = [never] * len(sequence)
    last: dict[int, int] = {}
    for i in range(len(sequence) - 1, -1, -1):
        next_use[i] = last.get(sequence[i], never)
        last[sequence[i]] = i
    resident: dict[int, int] = {e: last.get(e, never) for e in initial}  # expert -> next use
    furthest = [(-use, e) for e, use in resident.items()]  # stale entries skipped
    heapq.heapify(furthest)
    misses = 0
    for i, expert in enumerate(sequence):
        if expert not in resident:
            misses += counted[i]
            if len(resident) >= capacity:
                while True:
                    use, victim = heapq.heappop(furthest)
                    if resident.get(victim) == -use:
                        del resident[victim]
                        break
        resident[expert] = next_use[i]
        heapq.heappush(furthest, (-next_use[i], expert))
    return misses


def lru_misses(
    sequence: Sequence[int], counted: Sequence[float], capacity: int, initial: Sequence[int] = ()
) -> float:
    """Misses of LRU on the same sequence (what the engine's ``cache: lru`` does, up to
    the order it serves a call's experts in), the cache holding ``initial`` at the start
    (least recently used first)."""
    cache: OrderedDict[int, None] = OrderedDict((e, None) for e in initial)
    misses = 0
    for i, expert in enumerate(sequence):
        if expert in cache:
            cache.move_to_end(expert)
            continue
        misses += counted[i]
        if len(cache) >= capacity:
            cache.popitem(last=False)
        cache[expert] = None
    return misses
