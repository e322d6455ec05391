import time

import numpy as np
import pytest
import torch

from vllm_specexpert.config import LinkConfig, SpecExpertConfigError
from vllm_specexpert.tiers.link import CpuLink, ExpertCopy, make_link
from vllm_specexpert.tiers.store import LayerExperts


def whole(dst, src) -> ExpertCopy:
    """A transfer of the whole of ``src`` into ``dst`` (one expert of one tensor)."""
    return ExpertCopy(
        LayerExperts("w", {"w": src[None]}), {"w": dst[None]}, np.array([0]), np.array([0])
    )


def test_copies_are_real():
    link = CpuLink(LinkConfig())
    src = torch.randn(4, 100)
    dst = torch.zeros(4, 100)
    t = link.submit(
        ExpertCopy(LayerExperts("w", {"w": src}), {"w": dst}, np.arange(4), np.arange(4))
    )
    link.wait(t)
    assert torch.equal(dst, src)
    assert link.bytes_copied == src.numel() * 4 and link.copies == 4
    link.close()


def test_emulated_link_serializes_copies_and_holds_each_until_ready():
    # 1 GB/s and 100 ms per copy: the second submit comes long before the first is done
    # (a 1 ms copy raced a loaded machine).
    config = LinkConfig(bandwidth_gbps=1.0, latency_us=100_000.0)
    link = CpuLink(config)
    src = torch.zeros(250_000)  # 1 MB -> 1 ms + 100 ms latency
    dst = torch.empty_like(src)
    started = []
    start = time.perf_counter()
    first = link.submit(whole(dst, src), on_start=started.append)
    second = link.submit(whole(dst, src), on_start=started.append)
    assert second.ready_at is None and started == [first]  # queued behind the first
    link.wait(first)
    assert first.ready_at - start >= 101e-3 - 1e-6
    assert time.perf_counter() >= first.ready_at
    link.wait(second)
    assert started == [first, second]
    # The second copy starts when the link is free, like one copy engine.
    assert second.ready_at - first.ready_at == pytest.approx(101e-3, rel=1e-6)
    assert time.perf_counter() >= second.ready_at
    assert link.stall_s > 0
    link.close()


def test_copy_errors_reach_the_waiter():
    link = CpuLink(LinkConfig())
    t = link.submit(whole(torch.empty(3), torch.empty(4)))
    with pytest.raises(RuntimeError, match="expert copy failed"):
        link.wait(t)
    link.close()


def test_emulation_is_rejected_on_cuda():
    with pytest.raises(SpecExpertConfigError, match=r"link\.bandwidth_gbps"):
        make_link(LinkConfig(bandwidth_gbps=10), torch.device("cuda"))


def test_demand_copies_overtake_queued_prefetches_and_prefetches_cancel():
    # 1 MB at 1 GB/s + 100 ms: every submit below comes while the first copy runs (the
    # latency leaves room for a descheduled test thread on a loaded machine).
    link = CpuLink(LinkConfig(bandwidth_gbps=1.0, latency_us=100_000.0))
    src = torch.ones(250_000)
    dsts = [torch.zeros_like(src) for _ in range(4)]
    started = []
    busy = link.submit(whole(dsts[0], src), prefetch=True)  # starts at once
    later = link.submit(whole(dsts[1], src), prefetch=True, on_start=started.append)  # queued
    dropped = link.submit(whole(dsts[2], src), prefetch=True, on_start=started.append)  # queued
    demand = link.submit(whole(dsts[3], src))  # goes before both
    assert link.cancel(dropped) and not link.cancel(busy)
    # The copy thread may have written the dropped slot's bytes ahead of the emulated
    # timeline; the contract is that nothing lands there once cancel() returned, since
    # the slot is reused from then on.
    dsts[2].fill_(7.0)
    link.wait(demand)
    link.wait(later)
    assert demand.ready_at == pytest.approx(busy.ready_at + 101e-3, rel=1e-6)
    assert later.ready_at == pytest.approx(demand.ready_at + 101e-3, rel=1e-6)
    assert torch.equal(dsts[3], src) and torch.equal(dsts[1], src)
    assert link.bytes_copied == 3 * src.numel() * 4  # the cancelled copy never counted
    assert started == [later]  # and never reported a start
    link.close()  # joins the copy thread: every queued job has been handled
    assert torch.equal(dsts[2], torch.full_like(src, 7.0))
