"""``lookahead`` on the disk tier, on the widened model: the draft's INT4 experts are made
from the checkpoint expert by expert (the disk tier loads no expert), its routes prefetch
the target's experts from the pack. Greedy tokens and logprobs equal vanilla vLLM's (on a
CPU without AMX: see test_lookahead), the draft's tokens are accepted, and the target's
misses were read from the pack. An engine of its own module: vLLM's process state holds
one engine at a time."""

import pytest
from test_disk_tier import MODEL
from vllm_harness import (
    greedy,
    make_llm,
    shutdown,
    skip_unless_batch_invariant,
    vanilla_reference,
)

import vllm_specexpert


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    reference = vanilla_reference(MODEL)
    pack = tmp_path_factory.mktemp("lookahead") / "pack"
    llm = make_llm(
        MODEL,
        specexpert={
            "budget": 0.25,
            "disk": {"path": str(pack)},
            "lookahead": {"draft_budget": 0.25},
        },
    )
    yield llm, reference
    shutdown(llm)


def test_lookahead_on_the_disk_drafts_from_int4_copies_and_equals_vanilla(engine):
    llm, reference = engine
    outputs = greedy(llm)
    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["output"] == "exact" and stats["disk"]["reads"] > 0
    lookahead = stats["lookahead"]
    assert lookahead["drafted"] > 0 and lookahead["acceptance"] > 0.5
    # The draft's experts: INT4 copies of all of them in memory (about a quarter of their
    # bf16 bytes), and as many decoded as the target has slots (both a quarter).
    draft, layers = lookahead["draft"], stats["slot_bytes"]
    bf16 = sum(stats["experts_per_layer"][n] * layers[n] for n in layers)
    assert 0 < draft["int4_bytes"] < bf16 / 3
    assert draft["decoded_slot_bytes"] == sum(
        stats["slots_per_layer"][n] * layers[n] for n in layers
    )
    assert draft["decodes"] > 0
    skip_unless_batch_invariant("lookahead's output equals vanilla vLLM's")
    assert [c.token_ids for c in outputs] == [c.token_ids for c in reference]
    assert [c.logprobs for c in outputs] == [c.logprobs for c in reference]
