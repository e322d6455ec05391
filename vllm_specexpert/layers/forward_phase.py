"""Which tokens of the running forward pass are decode tokens, read from vLLM.

vLLM's attention metadata (in the forward context, one per pass) gives each request's
scheduled tokens, ``query_start_loc``. A request scheduled for one token is decoding,
one scheduled for more is computing its prompt (vLLM's own split,
``split_decodes_and_prefills`` with its default threshold of 1): a one-token prompt, or
the last chunk of a chunked prompt when it is one token long, counts as decode there too.
Passes without attention metadata (vLLM's profile and warm-up runs) count as prefill, so
they run exactly. The split is computed once per pass and kept in the forward context.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.forward_context import get_forward_context, is_forward_context_available

from vllm_specexpert.phases import PassPhases

_CONTEXT_KEY = "specexpert_phases"


def current_phases(num_tokens: int, decode_query_len: int = 1) -> PassPhases:
    """The decode/prefill split of the running pass's ``num_tokens`` tokens; a request
    scheduled at most ``decode_query_len`` tokens decodes (``1 + k`` under speculative
    decoding: a verification pass, as vLLM's ``reorder_batch_threshold``)."""
    if not is_forward_context_available():
        return PassPhases.prefill_only(num_tokens)
    context = get_forward_context()
    phases = context.additional_kwargs.get(_CONTEXT_KEY)
    if phases is None or phases.num_tokens != num_tokens:
        phases = _read_phases(context.attn_metadata, num_tokens, decode_query_len)
        context.additional_kwargs[_CONTEXT_KEY] = phases
    return phases


def _read_phases(
    attn_metadata: dict[str, Any] | list[dict[str, Any]] | None,
    num_tokens: int,
    decode_query_len: int = 1,
) -> PassPhases:
    if isinstance(attn_metadata, list):  # micro-batches: not used with the plugin
        attn_metadata = attn_metadata[0] if attn_metadata else None
    if not attn_metadata:
        return PassPhases.prefill_only(num_tokens)
    metadata = next(iter(attn_metadata.values()))
    if (
        getattr(metadata, "max_query_len", None) == 1
        and getattr(metadata, "num_actual_tokens", num_tokens) == num_tokens
    ):
        return PassPhases.decode_only(num_tokens)  # the common case: no host work
    start = getattr(metadata, "query_start_loc_cpu", None)
    if start is None:
        start = metadata.query_start_loc  # on CUDA a sync, in passes with a prompt only
    query_lens = np.diff(start.cpu().numpy())
    return PassPhases.from_query_lens(query_lens, num_tokens, decode_query_len)
