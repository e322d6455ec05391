"""``fetch``: load missed experts on demand, then run the router's routing exactly."""

from __future__ import annotations

from vllm_specexpert.config.modes import MISS_POLICIES
from vllm_specexpert.policy.base import MissPolicy


class FetchPolicy(MissPolicy):
    """No plan: every entry runs on the device, loaded on demand (see
    :class:`~vllm_specexpert.device_runs.one_launch.OneLaunch`)."""

    spec = MISS_POLICIES["fetch"]
