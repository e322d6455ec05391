"""Every expert in the slot of its id (``cache.identity``): one launch on the router's
ids as they are, all hits. The run of a layer that holds every expert; chosen when the
layer is composed (:func:`~vllm_specexpert.pipeline.compose`)."""

from __future__ import annotations

import time

import numpy as np
import torch

from vllm_specexpert.device_runs import kernel_launch
from vllm_specexpert.layer_call import NOTHING_FIRST, UNREAD, LayerCall
from vllm_specexpert.tiers.loader import ExpertLoader


def launch_resident(loader: ExpertLoader, call: LayerCall) -> torch.Tensor:
    """One launch on the call's rows, every expert in the slot of its id: the router's
    ids are the slot ids, all hits. Its distinct experts are counted (a token's top-k
    are distinct: nothing is read to the host for one token)."""
    stats, ids = call.stats, call.topk_ids
    tokens, top_k = ids.shape
    if tokens == 1:
        distinct = top_k
    else:
        host_ids = call.host_ids if call.host_ids is not UNREAD else ids.cpu().numpy()
        distinct = len(np.unique(host_ids))
    stats.experts_needed += distinct
    stats.requests += distinct
    stats.hits += distinct
    stats.kernel_calls += 1
    if (first := call.first_launch) is not NOTHING_FIRST:  # (the null object's run: hot)
        first.run()
    routing = loader.cache.kernel_routing(ids, None)
    started = time.perf_counter()
    out = kernel_launch.in_chunks(call, routing)
    stats.kernel_s += time.perf_counter() - started
    return out
