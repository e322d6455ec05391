import numpy as np
import pytest
import torch
from manual_clock import ManualClock

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
    # 1 GB/s and 100 ms per copy, on a clock only the link's waits move: the second
    # submit comes before the first is done however loaded the machine is.
    config = LinkConfig(bandwidth_gbps=1.0, latency_us=100_000.0)
    clock = ManualClock()
    link = CpuLink(config, clock)
    src = torch.zeros(250_000)  # 1 MB -> 1 ms + 100 ms latency
    dst = torch.empty_like(src)
    started = []
    first = link.submit(whole(dst, src), on_start=started.append)
    second = link.submit(whole(dst, src), on_start=started.append)
    assert second.ready_at is None and started == [first]  # queued behind the first
    assert link.wait(first) == pytest.approx(101e-3, rel=1e-9)  # held until it lands
    assert first.ready_at == pytest.approx(101e-3, rel=1e-9) and clock.now() == first.ready_at
    link.wait(second)
    assert started == [first, second]
    # The second copy starts when the link is free, like one copy engine.
    assert second.ready_at == pytest.approx(202e-3, rel=1e-9) and clock.now() == second.ready_at
    assert link.stall_s > 0
    link.close()


def test_a_demand_copy_on_a_real_link_is_waited_for_as_long_as_it_took(monkeypatch):
    # A real link copies a demand load in the submitting thread: the caller waits for it
    # there, and that wait is the stall its layer call reports (it once reported none,
    # so a disk read's wait showed up as the engine's own time). A prefetch does not:
    # the copy thread performs it, and a wait is only for what is left.
    clock = ManualClock()
    link = CpuLink(LinkConfig(), clock)
    copied = ExpertCopy.run

    def slow_run(copy):  # the read takes 2 s on the link's clock
        clock.advance(2.0)
        copied(copy)

    monkeypatch.setattr(ExpertCopy, "run", slow_run)
    src, dst = torch.ones(8), torch.zeros(8)
    demand = link.submit(whole(dst, src))
    assert link.wait(demand) == 2.0 and torch.equal(dst, src)
    prefetch = link.submit(whole(torch.zeros(8), src), prefetch=True)
    prefetch.done.wait()  # (the copy thread performed it: its 2 s passed before the wait)
    assert link.wait(prefetch) == 0.0
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
    # clock moves only when the link waits).
    link = CpuLink(LinkConfig(bandwidth_gbps=1.0, latency_us=100_000.0), ManualClock())
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


def test_a_copy_teaches_its_source_what_it_cost_and_the_link_asks_the_source(monkeypatch):
    from vllm_specexpert.tiers.link import base

    experts = LayerExperts("w", {"w": torch.zeros(2, 1000)})  # 4000 bytes an expert
    other = LayerExperts("v", {"v": torch.zeros(2, 1000)})
    ticks = iter([10.0, 10.004])  # by this clock, the copy takes 4 ms
    monkeypatch.setattr(base.time, "perf_counter", lambda: next(ticks))
    ExpertCopy(experts, {"w": torch.zeros(1, 1000)}, np.array([1]), np.array([0])).run()
    learned = 0.9 * 1e-10 + 0.1 * 0.004 / 4000
    assert experts.seconds_per_byte == pytest.approx(learned)
    assert other.seconds_per_byte == 1e-10  # each source its own (RAM, a disk, ...)
    link = CpuLink(LinkConfig())
    assert link.expert_seconds(experts) == pytest.approx(4000 * learned)
    link.close()
    # An emulated link's time is its own model's, whatever the source learned.
    emulated = CpuLink(LinkConfig(bandwidth_gbps=1.0, latency_us=10.0))
    assert emulated.expert_seconds(experts) == pytest.approx(10e-6 + 4000 / 1e9)
    emulated.close()
