"""``fetch``: load missed experts on demand, then run the router's routing exactly."""

from __future__ import annotations

from vllm_specexpert.config.modes import MISS_POLICIES
from vllm_specexpert.policy.base import MissPolicy


class FetchPolicy(MissPolicy):
    """No plan: every entry runs on the device, loaded on demand (see
    :func:`~vllm_specexpert.execute.run_on_device`)."""

    spec = MISS_POLICIES["fetch"]
