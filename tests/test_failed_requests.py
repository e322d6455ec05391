"""Requests whose experts could not be read fail, the others go on: the worker maps the
pass's failed rows to requests, the scheduler ends them with an error in the step's
outputs (their sampled token not sent) and frees the running ones."""

from types import SimpleNamespace

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import RequestStatus

from vllm_specexpert import handback
from vllm_specexpert.layers.failed_requests import requests_of_rows
from vllm_specexpert.schedule.scheduler import fail, sharing, written_blocks


def test_rows_map_to_the_requests_laid_out_in_input_batch_order():
    # a: rows 0-2 (a 3-token prompt chunk), b: row 3, c: rows 4-8; row 9 is padding.
    order = ["a", "b", "c"]
    scheduled = {"c": 5, "a": 3, "b": 1}  # (a dict in another order than the batch)
    assert requests_of_rows([0], order, scheduled) == ["a"]
    assert requests_of_rows([2, 3], order, scheduled) == ["a", "b"]
    assert requests_of_rows([4, 8], order, scheduled) == ["c"]
    assert requests_of_rows([9], order, scheduled) == []


def test_a_failed_request_ends_with_an_error_and_its_token_is_not_sent():
    finished: list[tuple[set, RequestStatus]] = []

    def finish_requests(ids, status):
        finished.append((set(ids), status))
        # "c" is still running (no output this step: a prompt chunk); "a" and "b" are
        # in this step's outputs; "a" also finished this step on its own (length).
        return [SimpleNamespace(request_id="c", client_index=1)]

    scheduler = SimpleNamespace(finish_requests=finish_requests)
    outputs = {
        0: EngineCoreOutputs(
            outputs=[
                EngineCoreOutput("a", [5], finish_reason=FinishReason.LENGTH),
                EngineCoreOutput("b", [7]),
            ]
        )
    }
    fail(scheduler, ["a", "c"], outputs)
    first = {o.request_id: o for o in outputs[0].outputs}
    assert first["a"].new_token_ids == [] and first["a"].finish_reason == FinishReason.ERROR
    assert first["b"].new_token_ids == [7] and first["b"].finish_reason is None
    assert [(o.request_id, o.finish_reason) for o in outputs[1].outputs] == [
        ("c", FinishReason.ERROR)
    ]
    assert finished == [({"a", "c"}, RequestStatus.FINISHED_ERROR)]


def test_the_failed_requests_ride_on_a_copy_of_the_output():
    shared = SimpleNamespace(req_ids=[])  # like vLLM's EMPTY_MODEL_RUNNER_OUTPUT
    sent = handback.attach_failed(shared, ["r1"])
    assert handback.failed_requests(sent) == ["r1"]
    assert handback.failed_requests(shared) == []  # never written to


def test_the_blocks_a_failed_step_wrote_are_found_and_the_requests_sharing_them():
    # Block size 4, one cache group and a sliding window's (its null block 0 held as a
    # placeholder). "a": a prompt chunk of positions 6..13 (blocks 1, 2, 3 of its table);
    # "b": one decode token at position 9 (its block 2); "c" shares a's blocks 10 and 11
    # (a prefix hit in the same step); "d" shares only a's block 10, written before.
    tables = {
        "a": ([10, 11, 12, 13], [0, 0, 22, 23]),
        "b": ([30, 31, 32], [0, 0, 42]),
        "c": ([10, 11, 14], [0, 0, 24]),
        "d": ([10, 15], [0, 25]),
    }
    groups = [SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=4))] * 2
    scheduler = SimpleNamespace(
        requests=dict.fromkeys(tables),
        running=[SimpleNamespace(request_id=r) for r in tables],
        kv_cache_config=SimpleNamespace(kv_cache_groups=groups),
        kv_cache_manager=SimpleNamespace(
            get_block_ids=tables.__getitem__,
            block_pool=SimpleNamespace(null_block=SimpleNamespace(block_id=0)),
        ),
    )
    output = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="a", num_computed_tokens=6)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["b"], num_computed_tokens=[9]),
        num_scheduled_tokens={"a": 8, "b": 1},
    )
    assert written_blocks(scheduler, output, ["a"]) == {11, 12, 13, 22, 23}
    assert written_blocks(scheduler, output, ["b"]) == {32, 42}
    assert written_blocks(scheduler, output, ["gone"]) == set()
    assert sharing(scheduler, {11, 12, 13, 22, 23}, ["a"]) == ["c"]
    assert sharing(scheduler, set(), ["a"]) == []
