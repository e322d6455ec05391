"""The ``lookahead`` draft's INT4 experts in the expert pack (``specexpert pack --draft``):
written after the target's regions in the form vLLM's CPU W4A16 GEMM reads, each expert
checked at every read, copied into the draft's slots through its host rows and computed
there packed; a pack without them is refused for ``lookahead`` naming ``disk.path`` and
the command that adds them; a flipped byte in a draft region fails that read only, and
the expert is read again next time."""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_expert_pack import MODEL, checkpoint_expert

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.layers.int4_copies import Int4DraftForm
from vllm_specexpert.layers.int4_gemm import Int4GemmExperts, gemm_built
from vllm_specexpert.layers.packed_experts import low_bit_parameters
from vllm_specexpert.tiers.disk import open_disk
from vllm_specexpert.tiers.expert_pack import DRAFT_PREFIX, RECORDS_FILE
from vllm_specexpert.tiers.host import torch_experts
from vllm_specexpert.tiers.host_cache import HostCache
from vllm_specexpert.tiers.kernel_form import DTYPES, cpu_kernel_form
from vllm_specexpert.tiers.pack_writer import prepare_pack, verify_pack
from vllm_specexpert.tiers.store import ExpertsUnreadable

FORM = cpu_kernel_form(torch.bfloat16)
DRAFT = Int4DraftForm(torch.bfloat16)
LAYER = "model.layers.1.mlp.experts"
HIDDEN, INTERMEDIATE, EXPERTS = 256, 64, 64
"""The embedded model's shape (its config.json)."""


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("draft") / "pack"
    prepare_pack(str(out), str(MODEL), FORM, DRAFT)
    return out


def dequantized(tensors: dict[str, torch.Tensor], stem: str) -> torch.Tensor:
    """A projection ``[N, K]`` from the GEMM's form, as its layout is documented (vLLM's
    ``CPUWNA16LinearKernel``): ``qweight [N/16, 2K]`` int32, 8 codes a word along the
    outputs in blocks of 16; ``scales [G, N]``, ``qzeros [G, N/8]``; ``(q - z) * s``. Or
    from ``lowbit``'s form, where the build has no GEMM (its own decoder)."""
    if f"{stem}_qweight" not in tensors:
        codes = low_bit_parameters("the draft", 1, HIDDEN, INTERMEDIATE)
        return codes.dequantize({n: t[None] for n, t in tensors.items()})[f"{stem}_weight"][0]
    qweight, scales, qzeros = (tensors[f"{stem}_{p}"] for p in ("qweight", "scales", "qzeros"))
    groups, n = scales.shape
    k = qweight.shape[1] // 2
    words = qweight.view(n // 16, k, 2).permute(1, 0, 2).reshape(k, n // 8)
    shifts = torch.arange(8, dtype=torch.int32) * 4
    codes = ((words[..., None] >> shifts) & 0xF).reshape(k, n)
    zeros = ((qzeros[..., None] >> shifts) & 0xF).reshape(groups, n)
    per_group = k // groups
    weight = (codes - zeros.repeat_interleave(per_group, 0)).float()
    return (weight * scales.float().repeat_interleave(per_group, 0)).t()


def draft_layer(disk, rows: int | None = None):
    """The draft's layer, read into its slots as it is: straight (computed packed, as on
    this build), or through ``rows`` host rows (where it is decoded)."""
    if rows is not None:
        disk.draft_cache = HostCache(rows, pinned=False)
    return disk.layer(DRAFT_PREFIX + LAYER)


def slots(record, n: int) -> dict[str, torch.Tensor]:
    return {t.name: torch.zeros(n, *t.shape, dtype=DTYPES[t.dtype]) for t in record.tensors}


@pytest.mark.skipif(
    not gemm_built(),
    reason="this vLLM build has no cpu_gemm_wna16 (its AVX2 build): the pack holds the "
    "draft in lowbit's form, which test_a_flipped_draft_byte_... reads decoded",
)
def test_the_drafts_experts_come_back_near_the_checkpoint_and_compute_packed(pack_dir):
    disk = open_disk(str(pack_dir), str(MODEL), 2, direct=True)
    try:
        pack = disk.pack
        # After every target layer, one per target layer, under the draft's names.
        targets = pack.manifest.layers
        assert [d.name for d in pack.manifest.draft_layers] == [
            DRAFT_PREFIX + t.name for t in targets
        ]
        assert pack.manifest.draft_layers[0].offset >= targets[-1].end
        record = pack.layers[DRAFT_PREFIX + LAYER]
        assert record.expert_nbytes < pack.layers[LAYER].expert_nbytes / 3
        experts = draft_layer(disk)
        ids = np.array([5, 9, 63])
        out = slots(record, 3)
        experts.copy_into(ids, np.array([2, 0, 1]), out)
        checkpoint = {e: checkpoint_expert(LAYER, e) for e in ids.tolist()}
        for i, expert in zip([2, 0, 1], ids.tolist(), strict=True):
            held = {name: t[i] for name, t in out.items()}
            for stem in ("w13", "w2"):
                want = checkpoint[expert][f"{stem}_weight"].float()
                error = (dequantized(held, stem) - want).abs().max()
                assert 0 < error < 0.1 * want.abs().max(), stem  # INT4: near, not equal
        # vLLM's GEMM on the slots, as the draft runs them: the experts' sum near the
        # checkpoint's, through the slots the copies went to.
        x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(0)).bfloat16()
        slot_ids = torch.tensor([[2, 0], [0, 1], [1, 2], [2, 1], [0, 2], [1, 0]])
        weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(1))
        got = Int4GemmExperts("silu")(x, weights, slot_ids, out).float()
        dense = {
            name: torch.stack([checkpoint[e][name] for e in (9, 63, 5)]).bfloat16()
            for name in ("w13_weight", "w2_weight")
        }
        want = torch_experts(x, weights, slot_ids, dense).float()
        assert (got - want).norm() < 0.15 * want.norm()
        # Computed packed, its slots are its cache: no host rows, read each time asked.
        assert experts.memory_nbytes == 0
        reads = disk.stats.reads
        experts.copy_into(ids, np.array([0, 1, 2]), slots(record, 3))
        assert disk.stats.reads == reads + 3
    finally:
        disk.close()


def test_a_pack_without_the_draft_is_refused_for_lookahead_naming_the_command(tmp_path):
    out = tmp_path / "pack"
    prepare_pack(str(out), str(MODEL), FORM)  # (no draft form: the target's only)
    with pytest.raises(SpecExpertConfigError) as refused:
        prepare_pack(str(out), str(MODEL), FORM, DRAFT)
    assert refused.value.field_name == "disk.path"
    assert "no experts of the lookahead draft" in refused.value.problem
    assert f"--out {out} --draft" in refused.value.fix
    # The target alone still opens it.
    assert not prepare_pack(str(out), str(MODEL), FORM).has_draft


def flip(path: Path, offset: int) -> None:
    """Invert one byte at ``offset``, keeping the file's times (a second call undoes it)."""
    stat = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_flipped_draft_byte_fails_that_read_only_and_is_read_again(pack_dir, tmp_path):
    copy = tmp_path / "pack"
    shutil.copytree(pack_dir, copy)
    disk = open_disk(str(copy), str(MODEL), 2, direct=True)
    try:
        record = disk.pack.layers[DRAFT_PREFIX + LAYER]
        offset = record.tensors[0].at(9) + 100
        flip(copy / RECORDS_FILE, offset)
        experts = draft_layer(disk, rows=4)
        with pytest.raises(ExpertsUnreadable) as unreadable:
            experts.copy_into(np.array([5, 9]), np.array([0, 1]), slots(record, 2))
        assert unreadable.value.layer == DRAFT_PREFIX + LAYER
        assert unreadable.value.experts == [9]
        assert unreadable.value.field == "disk.path"
        assert disk.stats.failed == 1 and disk.stats.checked == 1
        # Expert 5 was read and kept; 9 is read again next time, and whole again it passes.
        flip(copy / RECORDS_FILE, offset)
        out = slots(record, 2)
        experts.copy_into(np.array([5, 9]), np.array([0, 1]), out)
        assert disk.stats.checked == 2 and disk.draft_cache.stats_dict()["hits"] == 1
        want = checkpoint_expert(LAYER, 9)["w2_weight"].float()
        held = {name: t[1] for name, t in out.items()}
        assert (dequantized(held, "w2") - want).abs().max() < 0.1 * want.abs().max()
    finally:
        disk.close()


def test_verify_compares_the_drafts_regions_with_the_checkpoint(pack_dir, tmp_path):
    copy = tmp_path / "pack"
    shutil.copytree(pack_dir, copy)
    pack, problems = verify_pack(copy, MODEL, FORM, DRAFT)
    assert problems == []
    record = pack.layers[DRAFT_PREFIX + LAYER]
    flip(copy / RECORDS_FILE, record.tensors[-1].at(33) + 7)
    _, problems = verify_pack(copy, MODEL, FORM, DRAFT)
    assert len(problems) == 1
    assert f"{DRAFT_PREFIX + LAYER} expert 33's {record.tensors[-1].name}" in problems[0]


def test_the_drafts_slots_default_to_its_cache_or_top_k_on_the_disk_and_all_in_memory():
    from vllm_specexpert.config import SpecExpertConfig

    on_disk = SpecExpertConfig(lookahead={}, disk={"path": "/nonexistent"})
    # Under disk a decoded slot weighs a target slot: the fewest that run a token.
    assert on_disk.draft_config(top_k=4).slots_per_layer(EXPERTS, 4) == 4
    # Computed packed, its slots are its cache, sized by the caller (draft_cache's rows),
    # unless draft_budget says.
    assert on_disk.draft_config(top_k=4, slots=23).slots_per_layer(EXPERTS, 4) == 23
    said = SpecExpertConfig(lookahead={"draft_budget": 0.5}, disk={"path": "/nonexistent"})
    assert said.draft_config(top_k=4, slots=23).slots_per_layer(EXPERTS, 4) == EXPERTS // 2
    # The target's plan counted the slots it sized (one per slot of its own): they are
    # not checked again against what is free after it (that refused a 4 GB miniature).
    assert on_disk.draft_config(top_k=4, slots=23).allow_budget_beyond_memory
    assert not said.draft_config(top_k=4, slots=23).allow_budget_beyond_memory
    # draft_cache "auto": as many INT4 rows as the target's slots, never fewer than top_k.
    assert on_disk.draft_rows_follow_slots
    assert on_disk.draft_cache_rows(EXPERTS, 4, slots=23) == 23
    assert on_disk.draft_cache_rows(EXPERTS, 4, slots=2) == 4
    share = SpecExpertConfig(lookahead={"draft_cache": 0.25}, disk={"path": "/nonexistent"})
    assert not share.draft_rows_follow_slots
    assert share.draft_cache_rows(EXPERTS, 4, slots=23) == EXPERTS // 4
    in_memory = SpecExpertConfig(lookahead={})
    assert in_memory.draft_config(top_k=4).slots_per_layer(EXPERTS, 4) == EXPERTS
