"""``fetch``: load missed experts on demand, then run the router's routing exactly."""

from __future__ import annotations

from vllm_specexpert.policy.base import MissPolicy


class FetchPolicy(MissPolicy):
    """No plan: every entry runs on the device, loaded on demand (see
    :func:`~vllm_specexpert.policy.executor.run_on_device`)."""

    name = "fetch"
