"""``lookahead`` on the disk tier, on the widened model: the draft's INT4 experts are the
pack's draft regions (the start writes them with the pack), read into the draft.s
slots (as many as the target's: ``lookahead.draft_cache``), where vLLM's W4A16 GEMM
computes them packed; its routes prefetch the target's experts from the pack. Greedy
tokens and logprobs equal vanilla vLLM's (on a CPU without AMX: see test_lookahead), the
draft's tokens are accepted, and both read from the pack. A draft region that fails its
checksum fails no request: the draft proposes without that expert and the target
verifies. An engine of its own module: vLLM's process state holds one engine at a
time."""

import pytest
from test_disk_tier import MODEL
from vllm_harness import (
    PROMPTS,
    greedy,
    make_llm,
    shutdown,
    skip_unless_batch_invariant,
    vanilla_reference,
    vanilla_reference_ahead,
)

import vllm_specexpert
from vllm_specexpert.layers.int4_gemm import gemm_built


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("lookahead") / "pack"


@pytest.fixture(scope="module")
def engine(pack_dir):
    vanilla_reference_ahead(MODEL)  # (the other process runs it while this engine starts)
    llm = make_llm(
        MODEL,
        specexpert={
            "budget": 0.25,
            "disk": {"path": str(pack_dir)},
            # (a fixed length: the governor drafts nothing in a run this short)
            "lookahead": {"k": 3},
        },
    )
    yield llm, vanilla_reference(MODEL)
    shutdown(llm)


# Slow: an engine of its own, 53 s; lookahead's exactness runs in test_lookahead, the draft
# pack's regions in test_draft_pack.
@pytest.mark.slow
def test_lookahead_on_the_disk_drafts_from_the_packs_int4_regions_and_equals_vanilla(engine):
    llm, reference = engine
    outputs = greedy(llm)
    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["output"] == "exact" and stats["disk"]["reads"] > 0
    lookahead = stats["lookahead"]
    assert lookahead["drafted"] > 0 and lookahead["acceptance"] > 0.5
    # The draft's experts: INT4 (about a quarter of their bf16 bytes), read from the pack.
    draft, layers = lookahead["draft"], stats["slot_bytes"]
    bf16 = sum(stats["experts_per_layer"][n] * layers[n] for n in layers)
    assert 0 < draft["int4_bytes"] < bf16 / 3
    slots = {n: stats["slots_per_layer"][n] / stats["experts_per_layer"][n] for n in layers}
    assert set(slots.values()) == {0.25}
    # Where this build has the GEMM, computed packed, never decoded to bf16: its slots
    # are its only cache (no host rows), as many as the target has slots (draft_cache
    # "auto": a quarter). Its AVX2 build has none: decoded into bf16 slots, through rows.
    assert draft["computes_packed"] == gemm_built()
    if gemm_built():
        assert draft["int4_memory_bytes"] == 0 and "draft_cache" not in stats["disk"]
        assert draft["slot_bytes"] == pytest.approx(0.25 * draft["int4_bytes"])
    else:
        assert "draft_cache" in stats["disk"]
    assert draft["loads"] > 0 and draft["read_wait_s"] > 0
    skip_unless_batch_invariant("lookahead's output equals vanilla vLLM's")
    assert [c.token_ids for c in outputs] == [c.token_ids for c in reference]
    assert [c.logprobs for c in outputs] == [c.logprobs for c in reference]


def flip_draft_regions(pack_dir, index: int) -> bytes:
    """Flip a byte of every expert's first tensor in the ``index``-th draft layer of the
    pack; the file as it was."""
    from vllm_specexpert.tiers.expert_pack import ExpertPack

    records = pack_dir / "experts.bin"
    saved = records.read_bytes()
    layer = ExpertPack(pack_dir).manifest.draft_layers[index]
    tensor = layer.tensors[0]
    with open(records, "r+b") as f:
        for expert in range(layer.num_experts):
            f.seek(tensor.at(expert) + 3)
            f.write(bytes([saved[tensor.at(expert) + 3] ^ 0x01]))
    return saved


# (a draft region's checksum failure is test_draft_pack's unit test; here the engine)
@pytest.mark.slow
def test_a_draft_region_that_fails_its_checksum_fails_no_request(engine, pack_dir):
    from vllm import SamplingParams

    llm, reference = engine
    vllm_specexpert.reset_stats(llm)
    saved = flip_draft_regions(pack_dir, 2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    try:
        outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        (pack_dir / "experts.bin").write_bytes(saved)
    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["disk"]["failed"] > 0  # the draft read its flipped regions
    assert all(o.finish_reason != "error" for o in outputs)
    skip_unless_batch_invariant("the verified tokens equal vanilla vLLM's")
    for output, expected in zip(outputs, reference, strict=True):
        assert list(output.token_ids) == expected.token_ids[:16]
    # Whole again, the draft reads it again.
    vllm_specexpert.reset_stats(llm)
    greedy(llm)
    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["disk"]["failed"] == 0 and stats["disk"]["checked"] > 0
