"""The disk tier's mapped residency end to end on the widened model: the
first start makes the pack; greedy tokens and logprobs identical to vanilla vLLM's; a
page that fails to read fails the requests that needed it and only those; the file
truncated or written to under the engine fails requests, never the process (no SIGBUS)
and never with other tokens, and once it is whole again the output is as before. An
engine of its own module: vLLM's process state holds one engine at a time."""

import os

import pytest
from test_disk_tier import MODEL, change_every_expert, expert_parameters
from vllm_harness import MAX_TOKENS, PROMPTS, greedy, make_llm, shutdown, vanilla_reference

import vllm_specexpert
from specexpert_testbed.fixtures import num_moe_layers
from vllm_specexpert.tiers.expert_pack import ExpertPack


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mapped") / "pack"


@pytest.fixture(scope="module")
def engine(pack_dir):
    reference = vanilla_reference(MODEL)
    llm = make_llm(MODEL, specexpert={"disk": {"path": str(pack_dir), "residency": "mapped"}})
    yield llm, reference
    shutdown(llm)


def fail_pages_of(layer_index: int, expert: int | None):
    """Worker side (``apply_model``), the mapped residency: the pages of ``expert`` of
    the ``layer_index``-th MoE layer are out of the page cache and fail to read (EIO)
    from now on (``None``: they read again)."""

    def install(model) -> None:
        import errno

        from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts
        from vllm_specexpert.tiers import mapped

        layers = [m for m in model.modules() if isinstance(m, OffloadedRoutedExperts)]
        mapping = layers[0].engine.store.disk.mapping
        present = getattr(mapping, "unbroken_present", mapping._present)
        advise = getattr(mapping, "unbroken_advise", mapping._advise)
        mapping.unbroken_present, mapping.unbroken_advise = present, advise
        if expert is None:
            mapping._present, mapping._advise = present, advise
            return
        record = mapping.pack.layers[layers[layer_index].layer_name]
        bad = {mapping._pages(tensor, expert)[0] for tensor in record.tensors}

        def broken_advise(offset, length, advice):
            if offset in bad and advice == mapped.MADV_POPULATE_READ:
                raise OSError(errno.EIO, "Input/output error (injected by the test)")
            advise(offset, length, advice)

        mapping._present = lambda offset, length: offset not in bad and present(offset, length)
        mapping._advise = broken_advise

    return install


def test_the_mapped_pack_is_identical_to_vanilla(engine):
    llm, reference = engine
    outputs = greedy(llm)
    assert [c.token_ids for c in outputs] == [c.token_ids for c in reference]
    assert [c.logprobs for c in outputs] == [c.logprobs for c in reference]
    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["disk"]["residency"] == "mapped" and stats["output"] == "exact"
    assert {kind for _, kind, _ in llm.apply_model(expert_parameters)[0]} == {"MappedExperts"}


def test_a_page_that_fails_to_read_fails_only_the_requests_that_needed_it(engine):
    from vllm import SamplingParams

    llm, reference = engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.apply_model(fail_pages_of(num_moe_layers(MODEL) - 1, 20))
    try:
        outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.apply_model(fail_pages_of(0, None))
    failed = [o.finish_reason == "error" for o in outputs]
    assert any(failed) and not all(failed), failed
    for output, expected, error in zip(outputs, reference, failed, strict=True):
        if not error:  # the others ran exactly, as vanilla did
            assert list(output.token_ids) == expected.token_ids
    assert vllm_specexpert.get_stats(llm)[0]["disk"]["failed"] > 0
    assert [c.token_ids for c in greedy(llm)] == [c.token_ids for c in reference]


def test_a_file_truncated_under_the_engine_fails_requests_not_the_process(engine, pack_dir):
    from vllm import SamplingParams

    llm, reference = engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    records = pack_dir / "experts.bin"
    saved = records.read_bytes()
    last = ExpertPack(pack_dir).manifest.layers[-1]
    os.truncate(records, last.offset)  # every request needs the last layer
    try:
        outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        records.write_bytes(saved)
    assert all(o.finish_reason == "error" for o in outputs)  # (a SIGBUS kills this process)
    assert [c.token_ids for c in greedy(llm)] == [c.token_ids for c in reference]
    assert [c.logprobs for c in greedy(llm)] == [c.logprobs for c in reference]


def test_a_pack_written_to_between_generations_fails_requests_not_tokens(engine, pack_dir):
    # A byte of every expert's w2_weight in the 4th MoE layer changed between two
    # generations: the pages stay in the page cache and hold the new bytes. Every
    # request needs that layer: each fails, none finishes with other tokens.
    from vllm import SamplingParams

    llm, reference = engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    saved, _ = change_every_expert(pack_dir, 3)
    try:
        outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        failed = vllm_specexpert.get_stats(llm)[0]["disk"]["failed"]
    finally:
        (pack_dir / "experts.bin").write_bytes(saved)
    assert [o.finish_reason for o in outputs] == ["error"] * len(PROMPTS)
    assert failed > 0
    assert [c.token_ids for c in greedy(llm)] == [c.token_ids for c in reference]


def test_a_predictors_read_ahead_leaves_the_output_exact(engine):
    llm, reference = engine
    vllm_specexpert.reconfigure(llm, predictor="router")
    try:
        outputs = greedy(llm)
        stats = vllm_specexpert.get_stats(llm)[0]
    finally:
        vllm_specexpert.reconfigure(llm, predictor="none")
    assert [c.token_ids for c in outputs] == [c.token_ids for c in reference]
    assert [c.logprobs for c in outputs] == [c.logprobs for c in reference]
    assert stats["total"]["decode"]["predicted"] > 0  # (it predicted, and prefetched)
