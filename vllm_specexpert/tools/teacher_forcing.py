"""Teacher-forced decoding in vLLM: each request's output tokens are forced to a given
continuation, one decode step at a time, so that an approximate mode is scored on held-out
text along the decode path it really takes (cache state, residency, link) instead of in
one prefill pass.

Pass :class:`TeacherForcing` to ``LLM(logits_processors=[TeacherForcing])`` and the
continuation as ``SamplingParams(extra_args={"forced_tokens": [...]}, logprobs=1,
temperature=0)``. Logprobs are vLLM's raw ones (``logprobs_mode="raw_logprobs"``, the
default), taken before this processor: the returned top-1 is the model's own prediction
and the sampled token's logprob is the model's log-likelihood of the forced token.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

FORCED_TOKENS = "forced_tokens"


class TeacherForcing(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.requests: dict[int, tuple[list[int], list[int]]] = {}
        """Batch index -> (tokens to force, the request's live output-token list)."""

    def is_argmax_invariant(self) -> bool:
        return False  # it changes greedy choices: must run under temperature 0 too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def forced(params, _prompt_ids, output_ids):
            tokens = (params.extra_args or {}).get(FORCED_TOKENS)
            return (list(tokens), output_ids) if tokens else None

        process_dict_updates(self.requests, batch_update, forced)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (tokens, output_ids) in self.requests.items():
            position = len(output_ids)
            if position < len(tokens):
                logits[index] = float("-inf")
                logits[index, tokens[position]] = 0.0
        return logits
