"""The lookahead draft's rounds inside vLLM's worker (``lookahead``).

Around vLLM's draft proposer (:func:`vllm_specexpert.vllm_hooks.around_drafting`), per
step: feed the governor the verification's outcome and pass time; set its draft length
``k`` as ``num_spec_tokens_to_schedule``; open the target's lookahead round
(:class:`~vllm_specexpert.planner.lookahead.LookaheadPlanner`) while the draft runs; drop
the drafts of requests the governor stopped (a ragged list; async scheduling is off).
A request the token scheduler holds back keeps its drafted tokens until it runs again
(docs/design.md, "Draft lookahead": With the token scheduler).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from vllm_specexpert import vllm_hooks
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.features.lookahead import LookaheadFeature
from vllm_specexpert.log import init_logger

logger = init_logger(__name__)

_NOT_LOOKED_UP = object()
_active: LookaheadFeature | None = None
"""The target engine's lookahead whose drafting round runs now."""


def install() -> None:
    vllm_hooks.at_step_start(_step_started)
    vllm_hooks.around_drafting(_first_pass, _propose)


def _engine_of(runner: Any) -> OffloadEngine | None:
    """The runner's target engine if it runs ``lookahead``, else ``None`` (cached)."""
    cached = getattr(runner, "_specexpert_lookahead", _NOT_LOOKED_UP)
    if cached is not _NOT_LOOKED_UP:
        return cached  # type: ignore[return-value]  # (what this function cached)
    # The target model's offloaded layers hold its engine (the draft is apart).
    engine = next(
        (
            m.engine
            for m in runner.get_model().modules()
            if isinstance(getattr(m, "engine", None), OffloadEngine)
        ),
        None,
    )
    if engine is not None and engine.config.lookahead is None:
        engine = None
    runner._specexpert_lookahead = engine
    return engine


def _lookahead_of(runner: Any) -> LookaheadFeature | None:
    """The target engine's lookahead feature, looked up per step (``reconfigure``
    rebuilds it), once the draft is attached."""
    engine = _engine_of(runner)
    feature = engine.feature(LookaheadFeature) if engine is not None else None
    if feature is None or feature.planner is None:
        return None
    return feature


def _step_started(runner: Any, scheduler_output: Any) -> None:
    lookahead = _lookahead_of(runner)
    if lookahead is not None:
        for request in scheduler_output.finished_req_ids:
            lookahead.governor.finished(request)
        gone = scheduler_output.finished_req_ids | (scheduler_output.preempted_req_ids or set())
        lookahead.pass_started(scheduler_output.num_scheduled_tokens, gone)


def _first_pass(proposer: Any, token_indices_to_sample: torch.Tensor | None) -> None:
    if _active is not None and token_indices_to_sample is not None:
        _active.first_rows(np.asarray(token_indices_to_sample.cpu().numpy(), dtype=np.int64))


def _verification(
    sampled: Any, spec_decode_metadata: Any, requests: list[str]
) -> dict[str, tuple[int, int]]:
    """Request -> (drafted, accepted) tokens of the pass that just ran."""
    if spec_decode_metadata is None:
        return {}
    drafted = list(spec_decode_metadata.num_draft_tokens)
    if isinstance(sampled, torch.Tensor):
        produced = (sampled != -1).sum(dim=1).tolist()  # rejected positions are -1
    else:
        produced = [len(tokens) for tokens in sampled]
    return {
        request: (d, max(p - 1, 0))
        for request, d, p in zip(requests, drafted, produced, strict=True)
        if d > 0
    }


def _take_rows_back(target: OffloadEngine, draft: OffloadEngine) -> None:
    """The governor drafts for the first time: the target's slots that the draft's rows
    were lent to are freed (a rebuild on the plan without them), then the draft's slots
    are made (its warm start reads them)."""
    plan = target.budget.current
    assert plan is not None  # (the target was sized at its first layer)
    target.budget.draft_rows_made()
    if plan.lent:
        target.adopt(plan.drafting())
        logger.info(
            "specexpert: lookahead drafts from now on: the target gives back the %d slots "
            "a layer its draft's rows were lent to",
            plan.lent,
        )
    draft.equip_deferred()


def _propose(
    runner: Any,
    draft: Callable[[], Any],
    scheduler_output: Any,
    sampled: Any,
    spec_decode_metadata: Any,
) -> Any:
    """One drafting round (see module doc); ``draft()`` runs vLLM's proposer."""
    global _active
    lookahead = _lookahead_of(runner)
    if lookahead is None:
        return draft()
    requests = list(runner.input_batch.req_ids)
    last_end = getattr(runner, "_specexpert_round_end", None)
    start = time.perf_counter()
    verified = _verification(sampled, spec_decode_metadata, requests)
    # The time since the last round ended is the verifying pass's only if the pass ran
    # each request's sampled token and drafts, nothing more (no prompt or chunk).
    pass_s = None
    if (
        last_end is not None
        and spec_decode_metadata is not None
        and scheduler_output.total_num_scheduled_tokens
        == len(requests) + sum(spec_decode_metadata.num_draft_tokens)
    ):
        pass_s = start - last_end
    k = lookahead.begin_round(requests, verified, pass_s)
    if k and lookahead.draft.slots_deferred:
        target = _engine_of(runner)
        assert target is not None  # (its lookahead feature is ``lookahead``)
        _take_rows_back(target, lookahead.draft)
    scheduler_output.num_spec_tokens_to_schedule = k
    _active = lookahead
    try:
        with lookahead.draft_round(k):
            drafts = draft()
    finally:
        _active = None
        lookahead.end_round()
    end = runner._specexpert_round_end = time.perf_counter()
    keep = lookahead.drafted(requests, k, end - start)
    if (
        k
        and len(keep) < len(requests)
        and not runner.use_async_scheduling
        and isinstance(drafts, torch.Tensor)
    ):
        rows = drafts.tolist()
        drafts = [
            row if request in keep else [] for request, row in zip(requests, rows, strict=True)
        ]
    return drafts
