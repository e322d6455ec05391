"""Teacher-forced decoding in vLLM: each request's output tokens are forced to a given
continuation, one decode step at a time, so that an approximate mode is scored on held-out
text along the decode path it really takes (cache state, residency, link) instead of in
one prefill pass.

Pass :class:`TeacherForcing` to ``LLM(logits_processors=[TeacherForcing])`` and the
continuation as ``SamplingParams(extra_args={"forced_tokens": [...]}, logprobs=1,
temperature=0)``. Logprobs are vLLM's raw ones (``logprobs_mode="raw_logprobs"``, the
default), taken before this processor: the returned top-1 is the model's own prediction
and the sampled token's logprob is the model's log-likelihood of the forced token.

:func:`held_out_windows` cuts held-out text into windows; :func:`teacher_forced` runs
them, ``batch`` at a time (the benchmarks' and tests' accuracy along the decode path).
"""

from __future__ import annotations

import time

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


def held_out_windows(count: int, length: int = 256, split: str = "validation") -> list[list[int]]:
    """``count`` windows of ``length`` held-out tokens, spread over the ``split`` files
    (``validation``, or ``test``: whole packages held out)."""
    from vllm_specexpert.tools import corpus
    from vllm_specexpert.tools.embedded_model import load_tokenizer

    tokenizer = load_tokenizer()
    windows: list[list[int]] = []
    for f in corpus.corpus_files(split):
        ids = tokenizer.encode(f.read()).ids
        windows += [ids[i : i + length] for i in range(0, len(ids) - length + 1, length)]
    step = max(1, len(windows) // count)  # spread over the files
    return windows[::step][:count]


def teacher_forced(llm, windows: list[list[int]], prompt_tokens: int, batch: int = 1) -> dict:
    """Teacher-forced decode, ``batch`` windows at a time (submitted together, they
    decode together: ``batch`` sequences per decode step): the first ``prompt_tokens``
    of each window are the prompt, the rest is forced one decode step at a time (the
    engine needs ``logits_processors=[TeacherForcing]``), so every forced position runs
    the mode's real decode path. Returns the model's top-1 and the forced token's logprob per
    position (in window order), and the wall time."""
    from vllm import SamplingParams, TokensPrompt

    from vllm_specexpert.tools.teacher_forcing import FORCED_TOKENS as KEY

    top1, logprobs = [], []
    start = time.perf_counter()
    for first in range(0, len(windows), batch):
        group = windows[first : first + batch]
        prompts = [TokensPrompt(prompt_token_ids=w[:prompt_tokens]) for w in group]
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=len(w) - prompt_tokens,
                logprobs=1,
                ignore_eos=True,
                extra_args={KEY: w[prompt_tokens:]},
            )
            for w in group
        ]
        for window, out in zip(group, llm.generate(prompts, params, use_tqdm=False), strict=True):
            forced, sample = window[prompt_tokens:], out.outputs[0]
            assert list(sample.token_ids) == forced, "teacher forcing did not hold"
            for token, step in zip(forced, sample.logprobs, strict=True):
                top1.append(min(step.items(), key=lambda kv: kv[1].rank)[0])
                logprobs.append(step[token].logprob)
    return {"top1": top1, "logprobs": logprobs, "seconds": time.perf_counter() - start}
