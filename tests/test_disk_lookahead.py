"""``lookahead`` on the disk tier, on the widened model: the draft's INT4 experts are the
pack's draft regions (the start writes them with the pack), read into the draft's
slots (as many as the target's: ``lookahead.draft_cache``), where vLLM's W4A16 GEMM
computes them packed; its routes prefetch the target's experts from the pack. Under
``budget: "auto"`` the draft's rows are the target's slots until the governor first
drafts. Greedy tokens and logprobs equal vanilla vLLM's (on a CPU without AMX: see
test_lookahead), the draft's tokens are accepted, and both read from the pack. A draft
region that fails its checksum fails no request: the draft proposes without that expert
and the target verifies. An engine of its own module: vLLM's process state holds one
engine at a time."""

import dataclasses
import json

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
from specexpert_testbed.fixtures import model_path
from vllm_specexpert.layers.int4_gemm import gemm_built

GiB = 1 << 30
EXPLORE = 40
"""``lookahead.explore_after_tokens``: the governor drafts nothing for 10 steps of the
four prompts."""


def free_for_half_the_experts():
    """A memory report (the budget's) with room for half the widened model's experts
    past the KV cache (1 GiB, conftest), the reserve (1 GiB) and the workspace: under
    ``auto``, fewer slots than experts, so that the draft's rows are worth lending."""
    from vllm_specexpert.tiers import memory

    config = json.loads((model_path(MODEL) / "config.json").read_text())
    expert = 3 * config["hidden_size"] * config["moe_intermediate_size"] * 2  # bf16
    experts = config["num_hidden_layers"] * config["num_local_experts"] * expert

    def report(device, settings, freed_bytes=0):
        real = memory.memory_report(device, settings, freed_bytes)
        return dataclasses.replace(real, free_bytes=2 * GiB + (16 << 20) + experts // 2)

    return report


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("lookahead") / "pack"


@pytest.fixture(scope="module")
def engine(pack_dir):
    import vllm_specexpert.budget_plan as plan_module

    vanilla_reference_ahead(MODEL)  # (the other process runs it while this engine starts)
    with pytest.MonkeyPatch.context() as patch:  # (the start's plan; the engine in-process)
        patch.setattr(plan_module, "memory_report", free_for_half_the_experts())
        llm = make_llm(
            MODEL,
            specexpert={
                "disk": {"path": str(pack_dir)},
                "lookahead": {"explore_after_tokens": EXPLORE},
            },
        )
    yield llm, vanilla_reference(MODEL)
    shutdown(llm)


# Slow: an engine of its own, 53 s; lookahead's exactness runs in test_lookahead, the draft
# pack's regions in test_draft_pack.
@pytest.mark.slow
def test_lookahead_on_the_disk_drafts_from_the_packs_int4_regions_and_equals_vanilla(engine):
    llm, reference = engine
    # A run shorter than the governor's exploration drafts nothing: the draft's rows are
    # the target's slots, as many more a layer as their bytes make (not one more), and
    # the draft has no slot and reads nothing.
    first = greedy(llm, max_tokens=6)
    stats = vllm_specexpert.get_stats(llm)[0]
    lookahead, budget = stats["lookahead"], stats["budget"]
    assert lookahead["drafted"] == 0 and set(lookahead["steps_by_k"]) == {"0"}
    slots, lent = budget["slots_per_layer"], budget["lent_slots_per_layer"]
    experts = set(stats["experts_per_layer"].values()).pop()
    assert lent > 0 and slots + lent < experts
    assert set(stats["slots_per_layer"].values()) == {slots + lent}
    moe_layers = len(stats["layers"])
    layer_bytes = moe_layers * set(stats["slot_bytes"].values()).pop()
    rows = budget["draft_row_bytes"]  # (one INT4 row a layer, per slot)
    assert (slots + lent) * layer_bytes <= slots * (layer_bytes + rows)
    assert (slots + lent + 1) * layer_bytes > slots * (layer_bytes + rows)
    assert lookahead["draft"]["slot_bytes"] == 0 and lookahead["draft"]["loads"] == 0
    # The run goes on past the exploration: the governor drafts, the target gives the
    # rows back (its slots as sized with them) and the draft reads into them.
    outputs = greedy(llm)
    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["output"] == "exact" and stats["disk"]["reads"] > 0
    lookahead = stats["lookahead"]
    # (0.36 measured: the governor tries every length up to k_max = 4, and the first
    # drafts follow positions whose draft KV was computed without its experts; above 0.5
    # with k = 3 from the first step. A draft computing the wrong experts: near 0.)
    assert lookahead["drafted"] > 0 and lookahead["acceptance"] > 0.25
    assert stats["budget"]["lent_slots_per_layer"] == 0
    assert set(stats["slots_per_layer"].values()) == {slots}
    # The draft's experts: INT4 (about a quarter of their bf16 bytes), read from the pack.
    draft, layers = lookahead["draft"], stats["slot_bytes"]
    bf16 = sum(stats["experts_per_layer"][n] * layers[n] for n in layers)
    assert 0 < draft["int4_bytes"] < bf16 / 3
    # Where this build has the GEMM, computed packed, never decoded to bf16: its slots
    # are its only cache (no host rows), as many as the target has slots (draft_cache
    # "auto"). Its AVX2 build has none: decoded into bf16 slots, through rows.
    assert draft["computes_packed"] == gemm_built()
    if gemm_built():
        assert draft["int4_memory_bytes"] == 0 and "draft_cache" not in stats["disk"]
        assert draft["slot_bytes"] == pytest.approx(slots / experts * draft["int4_bytes"])
        assert draft["slot_bytes"] <= rows * slots  # (within the bytes the budget counted)
    else:
        assert "draft_cache" in stats["disk"]
    assert draft["loads"] > 0 and draft["read_wait_s"] > 0
    skip_unless_batch_invariant("lookahead's output equals vanilla vLLM's")
    assert [c.token_ids for c in first] == [c.token_ids[:6] for c in reference]
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
    vllm_specexpert.reconfigure(llm, lookahead={"k": 3})  # (every step drafts)
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
