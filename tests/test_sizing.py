"""Budget sizing (``config/sizing.py``): each slot count below is worked out by hand in
the comment beside it, from the published shapes of Qwen3-30B-A3B, Mixtral-8x7B and
GPT-OSS-20B (experts as the slots hold them: bf16), not from the code's output.

The shared assumptions: vLLM serves 16 sequences of 4096 tokens, 2048 tokens per pass;
on a GPU it may use 0.9 of the memory and sizes the KV cache from it; on the CPU build
the KV cache is explicit (1 GiB, ``VLLM_CPU_KVCACHE_SPACE``) unless a test says not."""

import re
from dataclasses import replace

import pytest

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.config.budget_form import parse_size
from vllm_specexpert.config.sizing import MemoryReport, ModelShapes, fit_budget

GiB = 1 << 30


def qwen3_30b(**extra) -> ModelShapes:
    # 48 MoE layers, 128 experts, top_k 8; an expert 3 x 2048 x 768 bf16 = 9,437,184 B;
    # KV 2 x 48 layers x 4 heads x 128 x 2 B = 98,304 B a token.
    return ModelShapes(48, 128, 8, 9_437_184, 768, 98_304, 16, 4096, 2048, **extra)


def mixtral_8x7b() -> ModelShapes:
    # 32 MoE layers, 8 experts, top_k 2; an expert 3 x 4096 x 14336 bf16 = 352,321,536 B;
    # KV 2 x 32 x 8 heads x 128 x 2 B = 131,072 B a token.
    return ModelShapes(32, 8, 2, 352_321_536, 14336, 131_072, 16, 4096, 2048)


def gpt_oss_20b() -> ModelShapes:
    # 24 MoE layers, 32 experts, top_k 4; an expert (3 x 2880 x 2880 + 3 x 2880 biases)
    # bf16 = 49,783,680 B; KV 2 x 24 x 8 heads x 64 x 2 B = 49,152 B a token.
    return ModelShapes(24, 32, 4, 49_783_680, 2880, 49_152, 16, 4096, 2048)


def gpu(total_gib: float, free_gib: float, freed: int = 0) -> MemoryReport:
    return MemoryReport(int(total_gib * GiB), int(free_gib * GiB), 0.9, None, freed)


def cpu(total_gib: float, free_gib: float) -> MemoryReport:
    return MemoryReport(int(total_gib * GiB), int(free_gib * GiB), 1.0, GiB)


def test_a_cpu_kv_cache_given_no_size_is_sized_for_the_batch():
    from vllm_specexpert.config.sizing import SizingSettings, kv_cache_for_batch

    # Qwen3-30B-A3B's 16 sequences of 4096 tokens: 16 x 4096 x 98,304 B = 6.0 GiB, and
    # vLLM's null block (128 tokens), while it is at most 0.25 of the memory free
    # (40 GiB: all of it; 12 GiB: 3 GiB), and at least one sequence (1 GiB: 0.375 GiB).
    block = 128 * 98_304
    batch = SizingSettings(
        kv_bytes_per_token=98_304, max_num_seqs=16, max_model_len=4096, block_size=128
    )
    assert kv_cache_for_batch(batch, 40 * GiB) == 6 * GiB + block
    assert kv_cache_for_batch(batch, 12 * GiB) == 3 * GiB
    assert kv_cache_for_batch(batch, GiB) == GiB * 3 // 8 + block
    # A sequence of 500 tokens takes 4 whole blocks, and the null block one more.
    one = SizingSettings(
        kv_bytes_per_token=98_304, max_num_seqs=1, max_model_len=500, block_size=128
    )
    assert kv_cache_for_batch(one, 40 * GiB) == 5 * block
    # Given that size, the plan says whom it holds: 3 GiB, 8 of the 16 sequences;
    # room 40 - 3 - 0.01171875 - 1 = 35.988 GiB / 0.421875 GiB a slot per layer = 85.3.
    fit = fit_budget("auto", qwen3_30b(), MemoryReport(64 * GiB, 40 * GiB, 1.0, 3 * GiB))
    assert fit.slots_per_layer == 85
    assert "KV cache 3.0 GiB (for 8 of the 16 full-length sequences" in fit.reason
    whole = fit_budget("auto", qwen3_30b(), MemoryReport(64 * GiB, 40 * GiB, 1.0, 6 * GiB))
    assert "KV cache 6.0 GiB (for 16 full-length sequences)" in whole.reason


def test_the_disk_tier_sizes_the_kv_cache_for_the_batch_that_reads_the_fewest_bytes():
    from vllm_specexpert.config.sizing import SizingSettings, best_batch

    # 2 MoE layers of 4 experts, top 2, 0.5 GiB each: a slot a layer takes 1 GiB. A
    # sequence's KV cache 0.25 GiB (1024 tokens of 256 KiB, no blocks); no workspace; the
    # reserve 1 GiB. A layer of B sequences needs 4 (1 - (1/2)^B) distinct experts
    # (2, 3, 3.5) and misses the share 1 - S/4 of them, read once for the batch.
    toy = ModelShapes(2, 4, 2, GiB // 2, 64, 1 << 18, 3, 1024, 0)
    settings = SizingSettings(kv_bytes_per_token=1 << 18, max_num_seqs=3, max_model_len=1024)
    # 4.5 GiB free: 1 sequence leaves 3 slots, 2 x 0.5 x 2 x 1/4 = 0.5 GiB a token; 2
    # sequences 3 slots, 1 x 3 x 1/4 / 2 = 0.375 GiB (the batch shares the reads); 3
    # sequences 2 slots, 1 x 3.5 x 1/2 / 3 = 0.58 GiB.
    tight = best_batch(settings, 9 * GiB // 2, toy)
    assert (tight.sequences, tight.slots_per_layer, tight.kv_bytes) == (2, 3, GiB // 2)
    assert tight.bytes_per_token == 3 * GiB / 8
    # 5.5 GiB: 1 and 2 sequences hold every expert (nothing read), 3 leave 3 slots (3.5 x
    # 1/4 / 3 of 1 GiB): at the tie, the larger batch.
    assert best_batch(settings, 11 * GiB // 2, toy).sequences == 2
    # The same 5.5 GiB of which the engine's processes will take 1 GiB: 4.5 GiB's choice.
    taken = best_batch(settings, 11 * GiB // 2, toy, engine_bytes=GiB)
    assert (taken.sequences, taken.slots_per_layer, taken.kv_bytes) == (2, 3, GiB // 2)
    assert "and 1.0 GiB for the engine's processes" in taken.reason
    # 6 GiB: every batch holds every expert: the largest, max_num_seqs.
    roomy = best_batch(settings, 6 * GiB, toy)
    assert (roomy.sequences, roomy.slots_per_layer, roomy.bytes_per_token) == (3, 4, 0.0)
    assert "KV cache 768.0 MiB for 3 full-length sequences of 1024 tokens" in roomy.reason
    # One layer of 4 experts of 1 GiB, 64 MiB of KV a sequence, 5 GiB free: every batch
    # leaves 3 slots. From 2 sequences a call may need all 4 experts, which 3 slots
    # cannot hold in one launch: 1 sequence (0.5 GiB a token), though 4 would share
    # their reads (4 (1 - 1/16) x 1/4 / 4 = 0.23 GiB a token) in token groups.
    one_layer = ModelShapes(1, 4, 2, GiB, 64, 1 << 16, 4, 1024, 0)
    small_kv = SizingSettings(kv_bytes_per_token=1 << 16, max_num_seqs=4, max_model_len=1024)
    alone = best_batch(small_kv, 5 * GiB, one_layer)
    assert (alone.sequences, alone.slots_per_layer) == (1, 3)
    # 4 layers of 8 experts, top 2, 0.25 GiB each (1 GiB a slot a layer), 1 MiB of KV a
    # sequence, 4.5 GiB free: 3 slots a layer at every batch, 12 in all. A call of 4
    # sequences may need all 8 experts: each layer keeps top_k = 2 of its own, the region
    # the other 4 rows, and 6 experts at once are fewer than 8 (token groups), though 12
    # slots outnumber them. 3 sequences need at most 6: read 8 (1 - (3/4)^3) x 5/8 / 3 =
    # 0.96 experts a token, against 1.09 for 2 and 1.25 for 1 (4 would read 0.85).
    layers = ModelShapes(4, 8, 2, GiB // 4, 64, 1 << 10, 4, 1024, 0)
    tiny_kv = SizingSettings(kv_bytes_per_token=1 << 10, max_num_seqs=4, max_model_len=1024)
    split = best_batch(tiny_kv, 9 * GiB // 2, layers)
    assert (split.sequences, split.slots_per_layer) == (3, 3)


def qwen3_30b_batch(max_model_len: int):
    """vLLM's settings and the shapes of Qwen3-30B-A3B at 256 sequences of ``max_model_len``."""
    from vllm_specexpert.config.sizing import SizingSettings

    settings = SizingSettings(
        kv_bytes_per_token=98_304,
        max_num_seqs=256,
        max_model_len=max_model_len,
        max_num_batched_tokens=2048,
        block_size=16,
    )
    return settings, replace(qwen3_30b(), max_num_seqs=256, max_model_len=max_model_len)


def test_a_long_context_keeps_slots_where_a_short_one_takes_the_whole_batch():
    from vllm_specexpert.config.sizing import best_batch, kv_cache_for_batch

    # Qwen3-30B-A3B, 20 GiB free, 256 sequences of 40960 tokens asked: a sequence's KV
    # 40960 x 98,304 B = 3.75 GiB, and the null block of 16 tokens; a slot a layer 48 x
    # 9,437,184 B = 0.421875 GiB; workspace 256 x 8 x 768 x 8 B, reserve 1 GiB.
    # 1 sequence: (20 - 3.75 - 0.0015 - 0.0117 - 1) / 0.421875 = 36 slots, 8 experts a
    #   token, 8 x 92/128 = 5.75 read: 5.75 x 48 x 9,437,184 B = 2.60 GB a token.
    # 2: 27 slots, 128 (1 - (120/128)^2) = 15.5 needed, 12.23 read, 6.12 a token.
    # 3: 18 slots, 22.53 needed, 19.36 read, 6.45; 4: 9 slots, 6.77; 5: no slots.
    settings, long = qwen3_30b_batch(40960)
    choice = best_batch(settings, 20 * GiB, long)
    assert (choice.sequences, choice.slots_per_layer) == (1, 36)
    assert choice.bytes_per_token == 5.75 * 48 * 9_437_184
    # The rule without the model's account gave 0.25 of the memory, 5 GiB, and 33 slots.
    assert kv_cache_for_batch(settings, 20 * GiB) == 5 * GiB
    # 512 tokens (48 MiB a sequence): no more than the rule without the model gives,
    # 0.25 of the memory, 5 GiB: 106 sequences (5.0 GiB with the null block) and 33
    # slots, (20 - 4.9703 - 0.0117 - 1) / 0.421875 = 33.2: 95/128 of nearly every expert
    # read, shared by 106 tokens (0.41 GB a token; 100 sequences, 33 slots: 0.43).
    short, shapes = qwen3_30b_batch(512)
    whole = best_batch(short, 20 * GiB, shapes)
    assert (whole.sequences, whole.slots_per_layer) == (106, 33)


# --- GPUs -------------------------------------------------------------------------


def test_an_8_gib_gpu_holds_top_k_of_qwen3_30b():
    # free 6.8 GiB once 1.2 GiB of weights and context are in; room = 6.8 - 0.1 x 8 = 6.0
    # KV: full 16 x 4096 x 98,304 = 6.0 GiB, capped at 0.25 x 6.0 = 1.5 GiB
    # workspace: a chunk of 256 of the 2048 batched tokens, 256 x 8 x 768 x 8 =
    # 0.01171875 GiB; reserve 1 GiB
    # space 6.0 - 1.5 - 0.01171875 - 1 = 3.488 GiB; a slot in every layer 48 x 9,437,184
    # = 452,984,832 B; 3.488 GiB / that = 8.27 -> 8 slots per layer.
    fit = fit_budget("auto", qwen3_30b(), gpu(8, 6.8))
    assert fit.slots_per_layer == 8
    assert fit.slot_bytes == 8 * 452_984_832
    assert "budget auto: 8 of 128 experts per layer" in fit.reason
    # A sequence's KV 4096 x 98,304 B = 0.375 GiB: 1.5 GiB holds 4 of the 16.
    assert "KV cache 1.5 GiB (for 4 of the 16 full-length sequences" in fit.reason


def test_a_24_gib_gpu_and_qwen3_30b():
    # free 22.3 GiB; room 22.3 - 2.4 = 19.9; KV min(6.0, 0.25 x 19.9 = 4.975) = 4.975
    # space 19.9 - 4.975 - 0.01171875 - 1 = 13.913 GiB -> / 452,984,832 B = 33.0 -> 32.
    assert fit_budget("auto", qwen3_30b(), gpu(24, 22.3)).slots_per_layer == 32


def test_an_80_gib_gpu_holds_five_of_mixtrals_eight_experts():
    # free 78 GiB; room 78 - 8 = 70; KV min(16 x 4096 x 131,072 = 8 GiB, 17.5) = 8 GiB
    # workspace 256 x 2 x 14336 x 8 = 0.0546875 GiB; space 70 - 8 - 0.0547 - 1 = 60.95 GiB
    # a slot in every layer: 32 x 352,321,536 B = 10.5 GiB -> 5.80 -> 5 slots.
    assert fit_budget("auto", mixtral_8x7b(), gpu(80, 78)).slots_per_layer == 5


def test_an_80_gib_gpu_holds_every_expert_of_gpt_oss_20b():
    # room 70; KV full 16 x 4096 x 49,152 = 3 GiB; workspace 256 x 4 x 2880 x 8 = 0.022
    # space 66.0 GiB / (24 x 49,783,680 B = 1.11 GiB) = 59 > 32 experts -> all 32.
    fit = fit_budget("auto", gpt_oss_20b(), gpu(80, 78))
    assert fit.slots_per_layer == 32
    assert "every expert fits" in fit.reason


def test_mixtral_on_a_24_gib_gpu_is_refused_naming_what_is_missing():
    # room 22 - 2.4 = 19.6; KV min(8, 4.9) = 4.9; space 19.6 - 4.9 - 0.0546875 - 1
    # = 13.645 GiB; top_k = 2 slots in every layer = 21 GiB: 7.355 GiB missing.
    with pytest.raises(SpecExpertConfigError, match=r"top_k \(2\).*7\.4 GiB is missing") as err:
        fit_budget("auto", mixtral_8x7b(), gpu(24, 22))
    assert err.value.field_name == "budget"


def test_the_workspace_is_one_kernel_chunks_not_the_whole_passes():
    # A pass runs the expert kernel in chunks of KERNEL_CHUNK_TOKENS (256) tokens: 2048
    # batched tokens count 256 x 8 x 768 x 8 B; 128 count themselves.
    import dataclasses

    parts = fit_budget("auto", qwen3_30b(), gpu(24, 22.3)).parts
    assert parts["workspace"] == 256 * 8 * 768 * 8
    short = dataclasses.replace(qwen3_30b(), max_num_batched_tokens=128)
    assert fit_budget("auto", short, gpu(24, 22.3)).parts["workspace"] == 128 * 8 * 768 * 8


def test_a_reconfigure_grows_only_into_memory_free_beyond_the_workspace():
    # At start (above): space 13.913 GiB, 32 slots per layer; a slot in every layer
    # is 452,984,832 B = 0.421875 GiB. Now 24 slots run (10.125 GiB) and the KV cache
    # (4.975 GiB) is allocated: free 22.3 - 10.125 - 4.975 = 7.2 GiB. The rebuild frees
    # the slots: room 7.2 + 10.125 - 2.4 = 14.925 GiB, less the workspace 0.01171875
    # and the reserve 1 = 13.913 GiB beyond what runs (the KV cache is not taken twice),
    # capped at the start's 13.913 GiB: 32 slots.
    start = fit_budget("auto", qwen3_30b(), gpu(24, 22.3))
    running = int(10.125 * GiB)
    now = gpu(24, 7.2, freed=running)
    assert fit_budget("auto", qwen3_30b(), now, planned=start.parts).slots_per_layer == 32
    # The process grew by 2 GiB since: 11.913 GiB -> 28.24 -> 28 slots.
    now = gpu(24, 5.2, freed=running)
    assert fit_budget("auto", qwen3_30b(), now, planned=start.parts).slots_per_layer == 28
    # It grew by 6 GiB: 7.913 GiB, less than runs now; it keeps the 24 slots it has.
    now = gpu(24, 1.2, freed=running)
    assert fit_budget("auto", qwen3_30b(), now, planned=start.parts).slots_per_layer == 24
    with pytest.raises(SpecExpertConfigError, match="at most 24 slots per layer"):
        fit_budget(28, qwen3_30b(), now, planned=start.parts)
    # Without the plan, the KV cache in use would be taken twice: 14.925 - 0.25 x 14.925
    # - 0.01171875 - 1 = 10.18 GiB -> 24 slots, not 32.
    assert fit_budget("auto", qwen3_30b(), gpu(24, 7.2, freed=running)).slots_per_layer == 24


# --- CPU boxes (the disk tier under the RAM slots) ---------------------------------


def disk_staging() -> int:
    # 2 x queue depth 4 read buffers and 4 experts being decoded: 12 x 9,437,184 B.
    return 12 * 9_437_184


@pytest.mark.parametrize(
    ("total", "free", "slots"),
    [
        # space = free - KV 1 - workspace 0.01171875 - staging 0.10546875 - reserve 1
        (16, 13.8, 27),  # 11.68 GiB / 452,984,832 B = 27.7
        (24, 21.8, 46),  # 19.68 GiB -> 46.7
        (128, 125.8, 128),  # 123.7 GiB -> 293: every expert, 128
    ],
)
def test_cpu_boxes_size_the_ram_slots_over_the_disk(total, free, slots):
    shapes = qwen3_30b(staging_bytes=disk_staging())
    assert fit_budget("auto", shapes, cpu(total, free)).slots_per_layer == slots


def test_a_cpu_box_without_room_for_top_k_is_refused():
    # 4 GiB box, 2.5 GiB free: space 2.5 - 1 - (0.01171875 + 0.10546875) - 1 = 0.38 GiB,
    # and top_k slots need 8 x 452,984,832 B = 3.375 GiB: 2.99 GiB missing.
    with pytest.raises(SpecExpertConfigError, match=r"top_k \(8\).*3\.0 GiB is missing"):
        fit_budget("auto", qwen3_30b(staging_bytes=disk_staging()), cpu(4, 2.5))


def test_a_lookahead_draft_built_after_the_slots_is_left_its_memory():
    # The 24 GiB box above (46 slots) with a draft of Qwen3-30B-A3B: per layer its 128
    # INT4 experts (about 2.5 MiB each: 320 MiB) and 16 slots (144 MiB, decoded), over 48
    # layers 21.75 GiB of the 19.68 left: not even top_k fits beside it.
    # Each part is named with its bytes: 48 x 320 MiB = 15 GiB of INT4 experts, 48 x 144
    # MiB = 6.75 GiB of slots.
    draft = {"draft_int4_bytes": 48 * 128 * 2_621_440, "draft_slot_bytes": 48 * 16 * 9_437_184}
    shapes = qwen3_30b(staging_bytes=disk_staging(), **draft)
    parts = r"lookahead draft 21\.8 GiB \(slots 6\.8 GiB, INT4 experts 15\.0 GiB\)"
    with pytest.raises(SpecExpertConfigError, match=parts):
        fit_budget("auto", shapes, cpu(24, 21.8))
    # On a 64 GiB box: 61.8 - 2.1171875 - 21.75 = 37.93 GiB -> 89 slots (without: all 128).
    fit = fit_budget("auto", shapes, cpu(64, 61.8))
    assert fit.slots_per_layer == 89
    assert re.search(parts, fit.reason)
    # The draft on the disk tier: its rows hold a quarter of its INT4 experts.
    quarter = qwen3_30b(
        staging_bytes=disk_staging(), **{**draft, "draft_int4_bytes": 48 * 32 * 2_621_440}
    )
    # 61.8 - 2.1171875 - 6.75 - 3.75 = 49.18 GiB -> 116 slots.
    assert fit_budget("auto", quarter, cpu(64, 61.8)).slots_per_layer == 116
    # draft_cache "auto": each slot brings its INT4 row, 48 x (9 + 2.5) MiB per slot per
    # layer: (61.8 - 2.1171875 - 6.75) GiB / 0.5390625 GiB = 98.2 -> 98 slots (and rows).
    rows = {"draft_slot_bytes": draft["draft_slot_bytes"], "draft_row_bytes": 48 * 2_621_440}
    fit = fit_budget("auto", qwen3_30b(staging_bytes=disk_staging(), **rows), cpu(64, 61.8))
    assert fit.slots_per_layer == 98
    assert "(slots 6.8 GiB), and its INT4 experts, 120.0 MiB with each slot" in fit.reason


def test_a_lookahead_draft_that_does_not_draft_yet_lends_its_rows_to_the_slots(monkeypatch):
    # A 48 GiB box with Qwen3-30B-A3B and its draft's INT4 rows sized with the slots:
    # (45.8 - 2.1171875) GiB / (48 x (9 + 2.5) MiB) = 81.03 -> 81 slots and 81 rows a
    # layer. The governor drafts nothing in a run's first tokens, and a draft that does
    # not draft reads none of its experts: until it first drafts, the rows are not made
    # and their bytes are the target's slots, 81 x 2,621,440 / 9,437,184 = 22.5 -> 22
    # more a layer.
    from types import SimpleNamespace

    import torch

    import vllm_specexpert.budget_plan as plan_module
    from vllm_specexpert.budget_plan import BudgetPlan
    from vllm_specexpert.config.sizing import SizingSettings

    def report(device, settings, freed_bytes=0):
        return replace(cpu(48, 45.8), freed_bytes=freed_bytes)

    monkeypatch.setattr(plan_module, "memory_report", report)
    expert, row = 9_437_184, 2_621_440
    experts = SimpleNamespace(num_experts=128, slot_nbytes=expert, staging_nbytes=disk_staging())

    def budget() -> BudgetPlan:
        plan = BudgetPlan(torch.device("cpu"))
        plan.sizing = SizingSettings(
            moe_layers=48,
            moe_intermediate_size=768,
            kv_cache_bytes=GiB,
            kv_bytes_per_token=98_304,
            max_num_seqs=16,
            max_model_len=4096,
            max_num_batched_tokens=2048,
            draft_row_bytes=48 * row,
        )
        return plan

    config = SpecExpertConfig.from_dict({"disk": {"path": "/pack"}, "lookahead": {}})
    assert config.lends_draft_rows  # (budget "auto", draft_cache "auto", k unset)
    plan = budget()
    start = plan.plan(config, experts, 8)
    assert (start.fit.slots_per_layer, start.lent) == (81, 22)
    assert (start.slots(128, 8), start.drafting().slots(128, 8)) == (103, 81)
    assert 103 * expert <= 81 * (expert + row)  # (no more than the slots and rows it lends)
    plan.adopt(start)
    assert plan.rows_lent
    # A rebuild meanwhile (a reconfigure) still leaves the rows their bytes.
    freed = 48 * 103 * expert
    assert plan.plan(config, experts, 8, freed).lent == 22
    # Once the draft has made its rows, a rebuild leaves them as they are (not lent).
    plan.draft_rows_made()
    assert plan.plan(config, experts, 8, freed).lent == 0
    # A draft length fixed from the start drafts at once, and a fraction is the user's
    # count: nothing is lent.
    for changed in ({"lookahead": {"k": 2}}, {"budget": 0.5}):
        other = config.changed(changed)
        assert not other.lends_draft_rows and budget().plan(other, experts, 8).lent == 0


# --- explicit budgets ----------------------------------------------------------------


def test_a_byte_budget_is_split_across_the_layers():
    # 12 GiB / (48 layers x 9,437,184 B) = 28.4 -> 28 slots per layer.
    assert fit_budget("12GiB", qwen3_30b(), None).slots_per_layer == 28
    # 800 MB buys 1 slot per layer, fewer than top_k: refused with the least that works.
    with pytest.raises(SpecExpertConfigError, match=r"fewer than top_k.*3\.4 GiB"):
        fit_budget("800MB", qwen3_30b(), None)
    # More than every expert: all of them (32 of GPT-OSS's, 38.2 GB).
    assert fit_budget("100GB", gpt_oss_20b(), None).slots_per_layer == 32


def test_an_explicit_budget_beyond_the_memory_is_refused_unless_insisted():
    # 24 GiB GPU: room for 32 slots per layer (above); a fraction 0.5 is 64.
    with pytest.raises(SpecExpertConfigError, match=r"at most 32 slots per layer") as err:
        fit_budget(0.5, qwen3_30b(), gpu(24, 22.3))
    assert err.value.field_name == "budget"
    assert fit_budget(0.5, qwen3_30b(), gpu(24, 22.3), True).slots_per_layer == 64
    assert fit_budget(32, qwen3_30b(), gpu(24, 22.3)).slots_per_layer == 32
    with pytest.raises(SpecExpertConfigError):
        fit_budget("16GiB", qwen3_30b(), gpu(24, 22.3))  # 37 slots per layer


# --- the config's sizes ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [("12GiB", 12 * GiB), ("800MB", 800_000_000), ("1.5 TiB", 3 * 2**39), ("64kb", 64_000)],
)
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("budget", "says"),
    [
        ("12 GB of stuff", "is not a size"),
        ("0GiB", "not a positive size"),
        ("-1GB", "is not a size"),
        ("12", "is not a size"),
        ("\u0664\u0668MiB", "is not a size"),  # (Arabic-Indic digits: not read as 48 MiB)
        ("12\u00a0GiB", "is not a size"),  # (a no-break space)
        (1.5, r"fraction must be in \(0, 1\]"),
        (0, r"count must be in \[2,"),
        ([12], "must be a fraction, a count, a size"),
    ],
)
def test_a_bad_budget_names_the_field(budget, says):
    with pytest.raises(SpecExpertConfigError, match=says) as err:
        SpecExpertConfig.from_dict({"budget": budget})
    assert err.value.field_name == "budget"


def test_auto_is_the_default_and_the_insisting_key_needs_an_explicit_budget():
    assert SpecExpertConfig.from_dict({}).budget == "auto"
    with pytest.raises(SpecExpertConfigError, match="has no effect with budget 'auto'"):
        SpecExpertConfig.from_dict({"allow_budget_beyond_memory": True})
    given = {"budget": "12GiB", "allow_budget_beyond_memory": True}
    assert SpecExpertConfig.from_dict(given).allow_budget_beyond_memory


def test_an_engine_built_from_another_setting_names_it_when_its_slots_do_not_fit(
    monkeypatch,
):
    """A lookahead draft's engine sizes ``lookahead.draft_budget``: its memory error
    names that setting, not ``budget``."""
    import dataclasses

    import torch
    from moe_reference import random_layer

    import vllm_specexpert.budget_plan as plan_module
    from vllm_specexpert.engine import OffloadEngine
    from vllm_specexpert.tiers import memory

    def no_room(device, settings, freed_bytes=0):  # nothing past the KV cache and reserve
        report = memory.memory_report(device, settings, freed_bytes)
        return dataclasses.replace(report, free_bytes=2 * GiB)

    monkeypatch.setattr(plan_module, "memory_report", no_room)
    for field in ("budget", "lookahead.draft_budget"):
        config = SpecExpertConfig.from_dict({"budget": 0.5})
        engine = OffloadEngine(config, torch.device("cpu"), reports=False, budget_field=field)
        engine.budget.sizing.moe_layers = 1
        engine.budget.sizing.kv_cache_bytes = GiB
        try:
            with pytest.raises(SpecExpertConfigError, match="do not fit") as err:
                engine.add_layer("layer0", random_layer(seed=0), top_k=4)
            assert err.value.field_name == field
        finally:
            engine.close()


# --- a container's memory limit (cgroups) -----------------------------------------------
# The machine: 24 GiB, 20 GiB of it free (MemAvailable); the KV cache explicit (1 GiB).

MAX_V1 = 9_223_372_036_854_771_712  # what cgroup v1 writes for no limit


def cgroup_tree(root, cgroup, files, mountinfo=None):
    """A fake ``/proc/self/cgroup`` (and ``mountinfo``) and cgroup files under ``root``."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    if mountinfo is not None:
        (root / "proc/self/mountinfo").write_text(mountinfo)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(str(text))
    return root


def on_the_machine(monkeypatch, root):
    """The memory report (:func:`memory_report`) sees the machine above, and reads the
    cgroups under ``root``."""
    import types

    from vllm_specexpert.tiers import memory

    ram = types.SimpleNamespace(available=20 * GiB, total=24 * GiB)
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: ram)
    read = memory.cgroup_memory
    monkeypatch.setattr(memory, "cgroup_memory", lambda: read(root))


def cpu_report(monkeypatch, root):
    """:func:`memory_report` on the CPU build of the machine above, its cgroups read under
    ``root``."""
    import torch

    from vllm_specexpert.config.sizing import SizingSettings
    from vllm_specexpert.tiers import memory

    on_the_machine(monkeypatch, root)
    return memory.memory_report(torch.device("cpu"), SizingSettings(kv_cache_bytes=GiB))


def six_gib_box(root):
    # cgroup v2, no mountinfo (the usual mount, /sys/fs/cgroup): limit 6 GiB; charged
    # 0.75 GiB, of which 0.25 GiB inactive page cache (reclaimable): 5.5 GiB left.
    return cgroup_tree(
        root,
        "0::/box\n",
        {
            "sys/fs/cgroup/box/memory.max": 6 * GiB,
            "sys/fs/cgroup/box/memory.current": int(0.75 * GiB),
            "sys/fs/cgroup/box/memory.stat": f"anon {GiB // 2}\ninactive_file {GiB // 4}\n",
        },
    )


def test_a_6_gib_cgroup_on_a_20_gib_free_machine_sizes_from_the_cgroup(tmp_path, monkeypatch):
    import dataclasses

    from vllm_specexpert.tiers.memory import CgroupMemory, cgroup_memory

    root = six_gib_box(tmp_path)
    assert cgroup_memory(root) == CgroupMemory(limit_bytes=6 * GiB, free_bytes=int(5.5 * GiB))
    report = cpu_report(monkeypatch, root)
    assert (report.free_bytes, report.cgroup_limit_bytes) == (int(5.5 * GiB), 6 * GiB)
    # free min(20, 5.5) = 5.5 GiB; space 5.5 - KV 1 - workspace 0.01171875 - reserve 1
    # = 3.488 GiB / 452,984,832 B (0.421875 GiB) = 8.27 -> 8 slots per layer.
    fit = fit_budget("auto", qwen3_30b(), report)
    assert fit.slots_per_layer == 8
    # The given 1 GiB holds 2 of the 16 sequences of 0.375 GiB.
    assert "5.5 GiB free (cgroup limit 6.0 GiB), KV cache 1.0 GiB (for 2 of the 16" in fit.reason
    assert fit.to_dict()["cgroup_limit_bytes"] == 6 * GiB
    # A rebuild names the limit measured then (raised to 8 GiB since: `docker update`).
    raised = dataclasses.replace(report, cgroup_limit_bytes=8 * GiB)
    rebuilt = fit_budget("auto", qwen3_30b(), raised, planned=fit.parts)
    assert rebuilt.parts["cgroup_limit"] == 8 * GiB
    # The machine's 20 GiB would have been 17.988 GiB of space: 42 slots per layer.
    bare = fit_budget("auto", qwen3_30b(), cpu(24, 20))
    assert bare.slots_per_layer == 42 and "cgroup" not in bare.reason


def test_the_start_line_and_the_stats_name_the_cgroup_limit(tmp_path, monkeypatch):
    import torch
    from moe_reference import random_layer

    from vllm_specexpert.engine import OffloadEngine

    on_the_machine(monkeypatch, six_gib_box(tmp_path))
    engine = OffloadEngine(SpecExpertConfig.from_dict({}), torch.device("cpu"), reports=False)
    engine.budget.sizing.moe_layers = 1
    engine.budget.sizing.kv_cache_bytes = GiB
    try:
        engine.add_layer("layer0", random_layer(seed=0), top_k=4)
        assert "(cgroup limit 6.0 GiB)" in engine.summary()  # the start line
        budget = engine.stats()["budget"]
        assert budget["cgroup_limit_bytes"] == 6 * GiB
        # room = what the cgroup leaves, not the machine's 20 GiB.
        assert budget["room_bytes"] == int(5.5 * GiB)
    finally:
        engine.close()


def test_a_cgroup_v1_limit_in_a_container(tmp_path, monkeypatch):
    # The container sees its memory cgroup /docker/abc mounted at /sys/fs/cgroup/memory
    # (the mount's root is /docker/abc: no cgroup namespace), beside an empty cgroup2
    # mount (hybrid). Limit 8 GiB; usage 2 GiB, 0.5 GiB of it inactive page cache over
    # the cgroup and its children (total_inactive_file): 6.5 GiB left.
    mountinfo = (
        "35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
    )
    memory_dir = "sys/fs/cgroup/memory"
    files = {
        f"{memory_dir}/memory.limit_in_bytes": 8 * GiB,
        f"{memory_dir}/memory.usage_in_bytes": 2 * GiB,
        f"{memory_dir}/memory.stat": f"inactive_file 0\ntotal_inactive_file {GiB // 2}\n",
        # Where the host would see it: not in the container (a reader that does not
        # take the mount's root finds this 1 GiB instead).
        f"{memory_dir}/docker/abc/memory.limit_in_bytes": GiB,
    }
    root = cgroup_tree(tmp_path, "4:memory:/docker/abc\n0::/\n", files, mountinfo)
    report = cpu_report(monkeypatch, root)
    assert (report.free_bytes, report.cgroup_limit_bytes) == (int(6.5 * GiB), 8 * GiB)
    # space 6.5 - 2.09375 = 4.40625 GiB / 0.421875 GiB = 10.4 -> 10 slots per layer.
    fit = fit_budget("auto", qwen3_30b(), report)
    assert fit.slots_per_layer == 10
    assert "(cgroup limit 8.0 GiB)" in fit.reason


@pytest.mark.parametrize(
    ("cgroup", "files"),
    [
        ("0::/box\n", {"sys/fs/cgroup/box/memory.max": "max"}),
        ("4:memory:/box\n", {"sys/fs/cgroup/memory/box/memory.limit_in_bytes": MAX_V1}),
        (None, {}),  # no cgroup at all (no /proc/self/cgroup)
    ],
    ids=["v2-max", "v1-huge", "none"],
)
def test_an_unlimited_cgroup_leaves_the_machines_memory(tmp_path, monkeypatch, cgroup, files):
    from vllm_specexpert.tiers.memory import cgroup_memory

    files = {**files, "sys/fs/cgroup/box/memory.current": 3 * GiB}
    root = cgroup_tree(tmp_path, cgroup, files) if cgroup else tmp_path
    assert cgroup_memory(root) is None
    report = cpu_report(monkeypatch, root)
    assert (report.free_bytes, report.cgroup_limit_bytes) == (20 * GiB, None)
    assert "cgroup" not in fit_budget("auto", qwen3_30b(), report).reason


def test_memory_high_binds_as_memory_max_does_and_the_cgroup_is_the_total(tmp_path, monkeypatch):
    # memory.max unset, memory.high 12 GiB (the kernel reclaims and throttles past it);
    # with vLLM's utilization 0.9 the share kept from the slots is 10 % of the cgroup's
    # 12 GiB, not of the machine's 24.
    import dataclasses

    from vllm_specexpert.tiers.memory import CgroupMemory, cgroup_memory

    files = {
        "sys/fs/cgroup/box/memory.max": "max",
        "sys/fs/cgroup/box/memory.high": 12 * GiB,
        "sys/fs/cgroup/box/memory.current": GiB,
        "sys/fs/cgroup/box/memory.stat": "inactive_file 0\n",
    }
    root = cgroup_tree(tmp_path, "0::/box\n", files)
    assert cgroup_memory(root) == CgroupMemory(limit_bytes=12 * GiB, free_bytes=11 * GiB)
    report = cpu_report(monkeypatch, root)
    assert (report.total_bytes, report.free_bytes) == (12 * GiB, 11 * GiB)
    fit = fit_budget("auto", qwen3_30b(), dataclasses.replace(report, utilization=0.9))
    assert fit.parts["room"] == pytest.approx(11 * GiB - 0.1 * 12 * GiB)


@pytest.mark.parametrize(
    ("outer", "outer_charged", "limit", "free"),
    [
        (4, 1, 4, 3),  # the ancestor's limit is tighter: 4 GiB, 4 - 1 left
        (8, 7, 6, 1),  # looser, but its other children charge 7 GiB: 8 - 7 left
    ],
)
def test_nested_v2_limits_the_tightest_ancestor_counts(
    tmp_path, monkeypatch, outer, outer_charged, limit, free
):
    # The process is in /a/b/c: a limited (outer), b unlimited, c 6 GiB with 1 GiB charged
    # (5 GiB left there); the least left over the levels binds.
    from vllm_specexpert.tiers.memory import CgroupMemory, cgroup_memory

    v2 = "sys/fs/cgroup"
    files = {
        f"{v2}/a/memory.max": outer * GiB,
        f"{v2}/a/memory.current": outer_charged * GiB,
        f"{v2}/a/b/memory.max": "max",
        f"{v2}/a/b/memory.current": outer_charged * GiB,
        f"{v2}/a/b/c/memory.max": 6 * GiB,
        f"{v2}/a/b/c/memory.current": GiB,
        f"{v2}/a/b/c/memory.stat": "inactive_file 0\n",
    }
    root = cgroup_tree(tmp_path, "0::/a/b/c\n", files)
    assert cgroup_memory(root) == CgroupMemory(limit * GiB, free * GiB)
    report = cpu_report(monkeypatch, root)
    assert (report.free_bytes, report.cgroup_limit_bytes) == (free * GiB, limit * GiB)
