"""How a layer call's device entries run, chosen once when the layer is composed
(:func:`device_run_for`), never by a flag on each call: every expert in the slot of its
id (:mod:`.resident`), else one launch over every expert the call needs
(:class:`~.one_launch.OneLaunch`), whose overflow, where a call's experts cannot fit
the pool together, is token groups (:mod:`.token_groups`: exact) or windows streamed
through the slots (:mod:`.streamed`: ``stream``, equivalent). Every launch goes through
:mod:`.kernel_launch`."""

from __future__ import annotations

from vllm_specexpert.device_runs.one_launch import OneLaunch
from vllm_specexpert.device_runs.streamed import Streamed
from vllm_specexpert.device_runs.token_groups import TokenGroups


def device_run_for(splits_tokens: bool = False) -> OneLaunch:
    """The run of a layer not all resident: one launch, with token groups where a call
    does not fit, or with windows streamed (``splits_tokens``: the miss policy's spec,
    ``stream``)."""
    return OneLaunch(Streamed() if splits_tokens else TokenGroups())
