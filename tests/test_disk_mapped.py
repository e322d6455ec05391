"""The disk tier's mapped residency end to end on the widened model: the
first start makes the pack; greedy tokens and logprobs identical to vanilla vLLM's; a
page that fails to read fails the requests that needed it and only those; the file
truncated or written to under the engine by another process (``pwrite``, a writable
shared mapping) fails requests while it holds the file and after, never the process (no
SIGBUS) and never with other tokens, and once it is whole again the output is as before
(nothing a failed pass computed is served from the prefix cache). An
engine of its own module: vLLM's process state holds one engine at a time."""

import os

import pytest
from other_writer import OtherWriter, wait_for_break
from test_disk_tier import MODEL, expert_parameters
from vllm_harness import (
    MAX_TOKENS,
    PROMPTS,
    greedy,
    make_llm,
    shutdown,
    vanilla_reference,
    vanilla_reference_ahead,
)

import vllm_specexpert
from specexpert_testbed.fixtures import num_moe_layers
from vllm_specexpert.tiers.expert_pack import ExpertPack


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mapped") / "pack"


@pytest.fixture(scope="module")
def engine(pack_dir):
    vanilla_reference_ahead(MODEL)  # (the other process runs it while this engine starts)
    llm = make_llm(MODEL, specexpert={"disk": {"path": str(pack_dir), "residency": "mapped"}})
    yield llm, vanilla_reference(MODEL)
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
        mapping = layers[0].engine.store.tier("disk").mapping
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


def lease_fd(llm) -> int:
    """The descriptor the engine holds its lease on the pack by (the worker is in this
    process: :func:`other_writer.wait_for_break` can ask it)."""

    def fd(model) -> int:
        from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts

        layer = next(m for m in model.modules() if isinstance(m, OffloadedRoutedExperts))
        return layer.engine.store.tier("disk").mapping.fd

    return llm.apply_model(fd)[0]


def writing(llm, pack_dir, **how) -> OtherWriter:
    """Another process that opens the pack for writing (:class:`OtherWriter`), once it
    waits in its open for the engine's lease."""
    writer = OtherWriter(pack_dir / "experts.bin", **how)
    wait_for_break(lease_fd(llm))
    return writer


def restored(llm, pack_dir, spans: list[tuple[int, bytes]]) -> None:
    """``spans`` written back by another process: its open waits for the engine, which
    lets go at its next call (a generation: it fails while the file is open for
    writing), then every expert is checked again."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1)
    generate = lambda: llm.generate(PROMPTS[:1], params, use_tqdm=False)
    writer = writing(llm, pack_dir, writes=spans)
    (failed,) = generate()
    writer.close()
    assert failed.outputs[0].finish_reason == "error"


def test_a_file_truncated_under_the_engine_fails_requests_not_the_process(engine, pack_dir):
    from vllm import SamplingParams

    llm, reference = engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    records = pack_dir / "experts.bin"
    last = ExpertPack(pack_dir).manifest.layers[-1]
    tail = records.read_bytes()[last.offset :]
    writer = writing(llm, pack_dir, truncate=last.offset)  # every request needs the last layer
    try:
        outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        writer.close()
    assert all(o.finish_reason == "error" for o in outputs)  # (a SIGBUS kills this process)
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert all(o.finish_reason == "error" for o in outputs)  # (closed: still truncated)
    restored(llm, pack_dir, [(last.offset, tail)])
    assert greedy(llm) == list(reference)  # (the logprobs too)


@pytest.mark.parametrize("how", ["pwrite", "mapped"])
def test_a_pack_written_to_under_the_engine_fails_requests_not_tokens(engine, pack_dir, how):
    # Another process changes a byte of every expert's w2_weight in the 4th MoE layer,
    # then holds the file open (mapped: through a writable shared mapping, a write to
    # an already written page moved no change time and went unseen). Every request
    # needs that layer: each fails while the writer holds the file and after, and none
    # finishes with other tokens; once the file is whole again, the output is exact.
    from vllm import SamplingParams

    llm, reference = engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    spans = every_expert_changed(pack_dir, 3)
    writer = writing(llm, pack_dir, mapped=how == "mapped")
    try:
        for _ in range(2):
            outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            assert [o.finish_reason for o in outputs] == ["error"] * len(PROMPTS)
            for at, data in spans:
                writer.write(at, bytes([data[0] ^ 0x01]))  # (again: the same pages)
    finally:
        writer.close()
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert [o.finish_reason for o in outputs] == ["error"] * len(PROMPTS)
    assert vllm_specexpert.get_stats(llm)[0]["disk"]["writes_seen"] > 0
    restored(llm, pack_dir, spans)
    assert greedy(llm) == list(reference)


def every_expert_changed(pack_dir, index: int) -> list[tuple[int, bytes]]:
    """Where a byte of every expert's ``w2_weight`` in the ``index``-th MoE layer is, and
    the byte: ``(offset, bytes)`` each."""
    layer = ExpertPack(pack_dir).manifest.layers[index]
    w2 = next(t for t in layer.tensors if t.name == "w2_weight")
    with open(pack_dir / "experts.bin", "rb") as f:
        return [
            (w2.at(e) + 10, os.pread(f.fileno(), 1, w2.at(e) + 10))
            for e in range(layer.num_experts)
        ]


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
