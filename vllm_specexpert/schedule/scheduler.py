"""The plugin's scheduler: vLLM's V1 scheduler that fails the requests whose experts
could not be read.

A worker whose slow tier could not supply an expert mid-generation (a disk read error,
a record whose checksum fails) ran the step without it, exactly for every other token,
and names the requests that needed it on the step's output
(:func:`vllm_specexpert.handback.failed_requests`). Here, after vLLM has processed that
output, each of those requests ends with ``FinishReason.ERROR``, and the token the step
sampled for it is not sent (the API server answers an error; ``LLM()`` returns the output
with ``finish_reason == "error"``). Every other request goes on; the engine stays up.

Nothing such a step wrote reaches another request: the KV blocks it wrote for a failed
request hold states computed without the expert, so they leave the prefix cache (a later
request with the same prompt computes them again), and a request that shares one of them
(a prefix hit on blocks scheduled in the same step) fails as well.

Installed as ``scheduler_config.scheduler_cls`` when the disk tier is on (the token
scheduler, :mod:`.token_scheduler`, is a subclass: with a ``path_predictor`` it is
installed instead).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import RequestStatus

from vllm_specexpert import handback

SCHEDULER_CLS = f"{__name__}.SpecExpertScheduler"
"""What the plugin sets as vLLM's ``scheduler_cls`` (with the disk tier)."""


class SpecExpertScheduler(Scheduler):
    """vLLM's scheduler that fails the requests a worker could not run (module doc)."""

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        failed = handback.failed_requests(model_runner_output)
        # (Read before vLLM frees the blocks of the requests that finish this step.)
        poisoned = written_blocks(self, scheduler_output, failed) if failed else set()
        failed += sharing(self, poisoned, failed)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if failed:
            self.kv_cache_manager.evict_blocks(poisoned)
            fail(self, failed, outputs)
        return outputs


def written_blocks(scheduler: Any, scheduler_output: Any, request_ids: list[str]) -> set[int]:
    """The KV blocks (ids, every cache group) the step wrote for ``request_ids``: those
    holding the positions it computed, from each request's computed tokens when it was
    scheduled on (the null block, a sliding window's placeholder, aside)."""
    starts = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    sizes = [g.kv_cache_spec.block_size for g in scheduler.kv_cache_config.kv_cache_groups]
    manager = scheduler.kv_cache_manager
    written: set[int] = set()
    for request_id in request_ids:
        if request_id not in starts or request_id not in scheduler.requests:
            continue
        start = starts[request_id]
        end = start + scheduler_output.num_scheduled_tokens.get(request_id, 0)
        for size, blocks in zip(sizes, manager.get_block_ids(request_id), strict=True):
            written.update(blocks[start // size : -(-end // size)])
    written.discard(manager.block_pool.null_block.block_id)
    return written


def sharing(scheduler: Any, blocks: set[int], failed: list[str]) -> list[str]:
    """The running requests, other than ``failed``, that hold any of ``blocks``."""
    if not blocks:
        return []
    manager = scheduler.kv_cache_manager
    return [
        request.request_id
        for request in scheduler.running
        if request.request_id not in failed
        and any(blocks.intersection(group) for group in manager.get_block_ids(request.request_id))
    ]


def fail(
    scheduler: Scheduler, request_ids: list[str], outputs: dict[int, EngineCoreOutputs]
) -> None:
    """End ``request_ids`` with an error in ``outputs`` (this step's, per client): the
    step's output of each is replaced by an error one; those still running are finished
    (their KV blocks freed) with ``FINISHED_ERROR``."""
    failed = set(request_ids)
    answered: set[str] = set()
    for engine_outputs in outputs.values():
        for i, output in enumerate(engine_outputs.outputs):
            if output.request_id in failed:
                engine_outputs.outputs[i] = error_output(output.request_id)
                answered.add(output.request_id)
    for request in scheduler.finish_requests(failed, RequestStatus.FINISHED_ERROR):
        if request.request_id not in answered:
            outputs.setdefault(request.client_index, EngineCoreOutputs()).outputs.append(
                error_output(request.request_id)
            )


def error_output(request_id: str) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ERROR
    )
