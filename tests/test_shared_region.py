"""The shared region's memory (:mod:`vllm_specexpert.tiers.shared_region`): every layer's
slot tensor covers its own rows and then the same region rows; the own rows are each
layer's; the mappings go with the last tensor on them."""

import gc
import re
from pathlib import Path

import pytest
import torch

from vllm_specexpert.tiers.shared_region import PAGE, SharedRegion

SHAPES = {
    "w13_weight": ((64, 24), torch.bfloat16),  # 3 KiB a row: not a whole page
    "w2_weight": ((32, 64), torch.bfloat16),  # 4 KiB a row
}


def region_mappings() -> int:
    """This process's mappings of a region's memfd."""
    maps = Path("/proc/self/maps").read_text()
    return len(re.findall(r"memfd:specexpert-region-", maps))


def test_every_layer_sees_the_same_region_rows_after_its_own():
    region = SharedRegion(3, SHAPES)
    first, second = region.views(5), region.views(2)
    for name, (shape, dtype) in SHAPES.items():
        a, b = first[name], second[name]
        assert a.shape == (8, *shape) and b.shape == (5, *shape) and a.dtype == dtype
        assert a.is_contiguous() and b.is_contiguous()
        assert (a.data_ptr() + 5 * a[0].nbytes) % PAGE == 0  # (the region starts a page)
        assert torch.count_nonzero(a) == 0 and torch.count_nonzero(b) == 0
        a[5 + 1] = 1.5  # a region row written through one layer's tensor ...
        assert torch.equal(b[2 + 1], a[5 + 1])  # ... is the other's
        b[0] = 2.0  # an own row is its layer's alone
        assert torch.count_nonzero(a[:5]) == 0
        assert torch.count_nonzero(b[1:2]) == 0
    region.close()


def test_the_mappings_go_with_the_last_tensor_on_them():
    before = region_mappings()
    region = SharedRegion(2, SHAPES)
    views = region.views(4)
    region.close()  # (the files may close first: the mappings hold the memory)
    assert region_mappings() == before + len(SHAPES)
    views["w2_weight"][4:] = 3.0  # still there
    row = views["w2_weight"][5].clone()
    del views
    gc.collect()
    assert region_mappings() == before
    assert torch.all(row == 3.0)


def test_a_region_needs_a_row():
    with pytest.raises(ValueError, match="at least one row"):
        SharedRegion(0, SHAPES)
