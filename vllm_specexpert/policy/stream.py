"""``stream``: load missed experts on demand as ``fetch`` does; a call whose experts do
not fit in the pool reads each missing one once, a token's experts then running in
different launches (:class:`~vllm_specexpert.device_runs.streamed.Streamed`)."""

from __future__ import annotations

from vllm_specexpert.config.modes import MISS_POLICIES
from vllm_specexpert.policy.base import MissPolicy


class StreamPolicy(MissPolicy):
    """No plan: every entry runs on the device, loaded on demand; the executor streams
    what does not fit (the spec's ``splits_tokens``)."""

    spec = MISS_POLICIES["stream"]
