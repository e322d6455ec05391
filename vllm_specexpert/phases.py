"""Which tokens of a forward pass are decode tokens and which are prefill tokens.

A decode token extends a request by one generated token; prefill tokens compute a
prompt (or a chunk of it). Prediction, prefetch, speculation and the non-exact miss
policies apply to decode tokens only; prefill tokens always run exactly. The vLLM adapter
reads the split from vLLM's attention metadata once per forward pass
(:mod:`vllm_specexpert.layers.forward_phase`); the engine only sees a :class:`PassPhases`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_NO_ROWS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class PassPhases:
    """Row indices of the decode and the prefill tokens of one forward pass."""

    num_tokens: int
    decode: np.ndarray
    """Rows of decode tokens (int64, ascending)."""
    prefill: np.ndarray
    """Rows of prefill tokens, including padding rows that belong to no request."""

    @property
    def all_decode(self) -> bool:
        return len(self.prefill) == 0

    @property
    def all_prefill(self) -> bool:
        return len(self.decode) == 0

    @classmethod
    def decode_only(cls, num_tokens: int) -> PassPhases:
        return cls(num_tokens, np.arange(num_tokens, dtype=np.int64), _NO_ROWS)

    @classmethod
    def prefill_only(cls, num_tokens: int) -> PassPhases:
        return cls(num_tokens, _NO_ROWS, np.arange(num_tokens, dtype=np.int64))

    @classmethod
    def from_query_lens(
        cls, query_lens: np.ndarray, num_tokens: int, decode_query_len: int = 1
    ) -> PassPhases:
        """The split of a pass whose requests are scheduled ``query_lens`` tokens each,
        in row order (as in vLLM's ``query_start_loc``). A request with at most
        ``decode_query_len`` tokens is decoding (vLLM's own split,
        ``split_decodes_and_prefills``); rows past the requests are padding."""
        query_lens = np.asarray(query_lens, dtype=np.int64)
        decoding = (query_lens > 0) & (query_lens <= decode_query_len)
        if decoding.all() and query_lens.sum() == num_tokens:
            return cls.decode_only(num_tokens)
        if not decoding.any():
            return cls.prefill_only(num_tokens)
        is_decode = np.zeros(num_tokens, dtype=bool)
        is_decode[: query_lens.sum()] = np.repeat(decoding, query_lens)
        return cls(num_tokens, np.flatnonzero(is_decode), np.flatnonzero(~is_decode))
