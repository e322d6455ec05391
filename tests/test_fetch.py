import numpy as np
import pytest
import torch
from invariants import check_cache_invariants
from moe_reference import (
    make_loader,
    random_layer,
    random_routing,
    reference_moe,
    run_fetch,
)

from vllm_specexpert.device_runs.token_groups import next_token_group
from vllm_specexpert.stats import PhaseStats


@pytest.mark.parametrize("policy", ["lru", "lfu", "lrfu", "static", "markov"])
@pytest.mark.parametrize("num_slots", [4, 6, 16])
@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_fetch_is_exact(policy, num_slots, tokens):
    tensors = random_layer(num_experts=16)
    loader = make_loader(tensors, num_slots=num_slots, top_k=4, policy=policy)
    stats = PhaseStats()
    for step in range(3):
        x, w, ids = random_routing(tokens, 16, 4, seed=step)
        expected = reference_moe(x, w, ids, tensors["w13_weight"], tensors["w2_weight"])
        needed = np.unique(ids.numpy())
        was_missing = int(np.count_nonzero(~loader.cache.resident_mask()[needed]))
        one_launch = loader.cache.capacity_for(needed)
        misses = stats.misses
        out = run_fetch(loader, x, w, ids, stats)
        assert torch.equal(out, expected)
        check_cache_invariants(loader)
        if one_launch:  # each needed expert is requested once: misses = those not resident
            assert stats.misses - misses == was_missing
    s = stats
    if num_slots < 16:
        assert s.misses > 0 and s.loads >= s.misses and s.bytes_loaded > 0
    else:
        assert s.misses == 0 and s.bytes_loaded == 0


def test_oversized_batch_runs_in_groups_and_loads_each_expert_few_times():
    tensors = random_layer(num_experts=16)
    loader = make_loader(tensors, num_slots=4, top_k=4)
    x, w, ids = random_routing(200, 16, 4)
    stats = PhaseStats()
    out = run_fetch(loader, x, w, ids, stats)
    assert torch.equal(out, reference_moe(x, w, ids, tensors["w13_weight"], tensors["w2_weight"]))
    assert stats.kernel_calls > 1
    # Worst case would be a full reload per token (4 x 200).
    assert stats.loads < 4 * 200
    check_cache_invariants(loader)


@pytest.mark.parametrize("device_run", ["token groups", "streamed"])
def test_a_calls_first_launch_work_runs_once_before_its_first_launch(device_run):
    # A call too big for the pool runs in several launches; the next layer's prefetch
    # (its FirstLaunch) must start once, before the first of them: not per part, and
    # not after the kernels.
    from moe_reference import slot_kernel

    from vllm_specexpert.device_runs import device_run_for
    from vllm_specexpert.layer_call import FirstLaunch, LayerCall

    tensors = random_layer(num_experts=16)
    loader = make_loader(tensors, num_slots=4, top_k=4)
    launches: list[int] = []
    ran_after: list[int] = []

    def counted_kernel(*args, **kwargs):
        launches.append(len(args[0]))
        return slot_kernel(*args, **kwargs)

    first = FirstLaunch()
    first.add(lambda: ran_after.append(len(launches)))
    x, w, ids = random_routing(64, 16, 4, seed=3)
    call = LayerCall("layer", counted_kernel, x, w, ids, first_launch=first)
    call = call.on_host(PhaseStats())
    device = device_run_for(splits_tokens=device_run == "streamed")
    out = device.run_all(loader, call)
    if device_run == "token groups":  # (streamed windows round a split token once more)
        assert torch.equal(
            out, reference_moe(x, w, ids, tensors["w13_weight"], tensors["w2_weight"])
        )
    assert len(launches) > 1
    assert ran_after == [0]
    assert not first.pending


def test_a_one_launch_call_writes_into_its_buffer_and_a_part_never_does():
    # The custom op's buffer (LayerCall.out) takes the one launch's result without a
    # copy; a launch on some of the rows must not write there (it would overwrite the
    # rows of another part).
    tensors = random_layer(num_experts=16)
    x, w, ids = random_routing(8, 16, 4, seed=4)
    expected = reference_moe(x, w, ids, tensors["w13_weight"], tensors["w2_weight"])
    for num_slots, one_launch in [(16, True), (4, False)]:
        from moe_reference import slot_kernel

        from vllm_specexpert.device_runs import device_run_for
        from vllm_specexpert.layer_call import LayerCall

        def writing_kernel(x, weights, ids, slots, expert_map=None, *, out=None, **kwargs):
            result = slot_kernel(x, weights, ids, slots, expert_map)
            if out is None:
                return result
            assert out.shape == result.shape  # (a part writing the whole buffer: a bug)
            out.copy_(result)
            return out

        loader = make_loader(tensors, num_slots=num_slots, top_k=4)
        buffer = torch.full_like(x, float("nan"))
        call = LayerCall("layer", writing_kernel, x, w, ids, out=buffer).on_host(PhaseStats())
        out = device_run_for().run_all(loader, call)
        assert torch.equal(out, expected)
        assert (out is buffer) == one_launch
        assert buffer.isnan().all() != one_launch  # (a part wrote nothing there)


def test_token_group_respects_capacity():
    cache = make_loader(random_layer(num_experts=16), num_slots=6, top_k=2, policy="static").cache
    ids = np.array([[10, 11], [12, 13], [0, 10], [14, 15], [1, 2]])
    group = next_token_group(cache, ids, np.arange(len(ids)))
    # pinned resident experts 0..3 are free; only two rotating slots remain
    non_pinned = {int(e) for e in ids[group].ravel()} - {0, 1, 2, 3}
    assert len(non_pinned) <= 2
    assert 4 in group  # fully resident token is picked first


def test_fetch_counts_a_resident_batch_as_hits():
    tensors = random_layer(num_experts=16)
    loader = make_loader(tensors, num_slots=8, top_k=2)
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    x = torch.randn(2, 32).bfloat16()
    w = torch.full((2, 2), 0.5)
    stats = PhaseStats()
    run_fetch(loader, x, w, ids, stats)
    assert (stats.hits, stats.misses, stats.loads) == (4, 0, 0)
    # The calls' demand: distinct experts of each routing (4, 2, 2).
    run_fetch(loader, x, w, torch.tensor([[0, 1], [1, 0]], dtype=torch.int32), stats)
    run_fetch(loader, x[:1], w[:1], torch.tensor([[5, 9]], dtype=torch.int32), stats)
    assert stats.experts_needed == 4 + 2 + 2


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_device_map_path_is_exact_through_prefetches_and_cancellations(tokens, monkeypatch):
    # The CUDA way of finding slots (router ids + expert_map kept on the "device"), run
    # on the CPU, the map written by torch instead of the Triton kernel: a map entry left
    # stale by any residency change would send a token to another expert's slot.
    from vllm_specexpert.config import LinkConfig
    from vllm_specexpert.tiers import cache as cache_module
    from vllm_specexpert.tiers.link import CpuLink

    def write_on_the_host(expert_map, experts, slots):
        expert_map[experts.long()] = slots

    monkeypatch.setattr(cache_module, "write_slot_map", write_on_the_host)

    tensors = random_layer(num_experts=16)
    # 2 ms per copy: prefetches queue behind each other, so unused ones get cancelled.
    link = CpuLink(LinkConfig(bandwidth_gbps=50.0, latency_us=2000.0))
    loader = make_loader(tensors, num_slots=6, top_k=4, link=link, device_map=True)
    cache = loader.cache
    stats = PhaseStats()
    rng = np.random.default_rng(0)
    for step in range(8):
        x, w, ids = random_routing(tokens, 16, 4, seed=step)
        # Every other step prefetches experts the call will not need (then dropped or
        # unused), else any (often used).
        pool = np.setdiff1d(np.arange(16), ids.numpy()) if step % 2 else np.arange(16)
        loader.prefetch(rng.permutation(pool)[:3], stats)
        out = run_fetch(loader, x, w, ids, stats)
        assert torch.equal(
            out, reference_moe(x, w, ids, tensors["w13_weight"], tensors["w2_weight"])
        )
        # After a launch the device map is the host map, evictions included.
        assert torch.equal(cache.expert_map, torch.from_numpy(cache.expert_slot))
        check_cache_invariants(loader)
    assert stats.misses > 0
    if tokens < 16:  # else every expert is needed: nothing to cancel
        assert stats.prefetch_cancelled > 0
    link.close()


@pytest.mark.parametrize("budget", [1.0, 0.25], ids=["resident", "fetch"])
def test_a_calls_seconds_hold_its_kernels_seconds_and_no_more(toy_engines, monkeypatch, budget):
    # The decode step's breakdown (bench-disk): on a clock that only the kernel moves,
    # each launch adds its 1 s to kernel_s, and call_s is the kernels' seconds and
    # nothing else (the engine's own work takes none of this clock's time).
    from types import SimpleNamespace

    from moe_reference import slot_kernel

    from vllm_specexpert import pipeline
    from vllm_specexpert.device_runs import kernel_launch, resident
    from vllm_specexpert.layer_call import LayerCall

    clock = [0.0]

    def timed_kernel(*args, **kwargs):
        clock[0] += 1.0
        return slot_kernel(*args, **kwargs)

    fake_time = SimpleNamespace(perf_counter=lambda: clock[0])
    name = "model.layers.0.mlp.experts"
    engine = toy_engines({"budget": budget}, {name: random_layer(num_experts=16)}, 4)
    monkeypatch.setattr(kernel_launch, "time", fake_time)
    monkeypatch.setattr(resident, "time", fake_time)
    monkeypatch.setattr(pipeline, "time", fake_time)
    for step, tokens in enumerate([1, 1, 3]):
        x, w, ids = random_routing(tokens, 16, 4, seed=step)
        engine.run_call(LayerCall(name, timed_kernel, x, w, ids))
    decode = engine.stats()["total"]["decode"]
    assert decode["kernel_calls"] >= 3
    assert decode["kernel_s"] == decode["kernel_calls"] == decode["call_s"]
