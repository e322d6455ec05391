"""Counters the engine keeps per MoE layer, and their JSON form."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass


@dataclass
class LayerStats:
    """Counters of one MoE layer. Expert requests are counted once per distinct expert
    per kernel call (a token batch that needs expert 5 for 30 tokens is one request)."""

    calls: int = 0
    """Forward calls of the layer (one per model step)."""
    tokens: int = 0
    """Tokens that went through the layer."""
    requests: int = 0
    """Distinct experts asked for, summed over kernel calls."""
    hits: int = 0
    """Requests found resident in the device cache."""
    misses: int = 0
    """Requests that were not resident (each triggers a load under ``fetch``).
    Experts still in flight from a prefetch count as hits."""
    loads: int = 0
    """Experts copied from the slow tier into a slot (on demand or prefetched)."""
    evictions: int = 0
    """Resident experts replaced to make room."""
    bytes_loaded: int = 0
    """Bytes copied over the link into this layer's slots (including prefetches)."""
    stall_s: float = 0.0
    """Seconds the compute waited on this layer's transfers (on-demand loads, and
    prefetches not finished when the layer needed them)."""
    prefetched: int = 0
    """Experts loaded ahead of use, by a prediction made at the previous layer or as
    ``admitted`` experts (cancelled ones excluded)."""
    admitted: int = 0
    """Of those, experts computed on the host and then loaded in the background on an
    idle link (``admit_host_experts``)."""
    bytes_prefetched: int = 0
    """Bytes of those prefetches (included in ``bytes_loaded``)."""
    prefetch_used: int = 0
    """Prefetched experts the layer then asked for."""
    prefetch_unused: int = 0
    """Prefetched experts the layer did not ask for and that had already moved (wasted
    link time)."""
    prefetch_cancelled: int = 0
    """Prefetches the layer did not ask for that had not started when it ran: dropped
    from the link queue, no link time spent (not counted in ``prefetched``)."""
    prefetch_skipped: int = 0
    """Predicted, non-resident experts not prefetched because their measured chance of
    use did not pay for the copy (``prefetch_filter: cost``)."""
    predicted: int = 0
    """Router-chosen (token, expert) pairs checked against a prediction made at the
    previous layer."""
    predicted_correct: int = 0
    """Of those, pairs the prediction contained: ``predicted_correct / predicted`` is
    the online recall@k of the predictor for this layer."""
    speculated_calls: int = 0
    """Forward calls that ran the predicted experts with the predicted weights
    instead of the router's (miss policy ``speculate``; output not exact)."""
    missed_entries: int = 0
    """Router-chosen (token, expert) entries whose expert was not resident when the
    layer call started; each was resolved in one of the next four ways."""
    fetched_entries: int = 0
    """Missed entries whose expert was loaded on demand (``fetch``, fallbacks)."""
    host_entries: int = 0
    """Missed entries computed on the host from the slow tier (``cpu``, ``auto``)."""
    substituted_entries: int = 0
    """Missed entries run with a resident substitute instead (``buddy``, ``random``,
    ``auto_buddy``; output not exact)."""
    dropped_entries: int = 0
    """Missed entries not run at all (``drop``; output not exact)."""
    host_experts: int = 0
    """Distinct experts computed on the host, summed over layer calls."""
    host_s: float = 0.0
    """Seconds of host expert compute (emulated seconds with an emulated link)."""
    host_stall_s: float = 0.0
    """Seconds layer calls waited for the host after their device work was done."""
    kernel_calls: int = 0
    """Expert kernel launches (more than ``calls`` when a batch needed more experts
    than there are slots and was run in token groups)."""
    max_resident: int = 0
    """Highest number of experts resident at once since the counters started (checked
    at start and after every load; never above the slot count)."""

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def recall(self) -> float:
        return self.predicted_correct / self.predicted if self.predicted else 0.0

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["hit_rate"] = self.hit_rate
        out["recall"] = self.recall
        return out


def write_json_atomic(path: str, payload: dict) -> None:
    """Write ``payload`` to ``path`` so that readers never see half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
