"""The properties of vLLM's CPU fused-MoE kernel that make offloading exact.

``fetch`` runs experts from a compact slot pool and, for batches that need more experts
than the pool holds, in token groups. Both are bit-exact only if the kernel (1) prepacks
each expert independently, (2) gives the same result for a token whatever expert ids
and slot order it is addressed with, and (3) computes each token independently of the
other tokens of the launch. These tests pin those properties on vLLM's real kernel, with
the instruction set vLLM picks for unquantized MoE on the running machine (``amx`` where
the CPU has AMX tiles, ``vec`` otherwise; printed with ``-s``), so an upgrade or a machine
that breaks them fails here rather than as a silent drift.
"""

import pytest
import torch

ops = pytest.importorskip("vllm._custom_ops", reason="needs vLLM's CPU kernels")

from moe_reference import make_loader, random_routing, run_fetch, vllm_isa  # noqa: E402

from vllm_specexpert.stats import PhaseStats  # noqa: E402

E, H, INTER, K = 16, 256, 128, 4


ISA = vllm_isa()
print(f"vLLM's CPU MoE kernel on this machine: isa={ISA!r}")


def prepacked(seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * INTER, H, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(E, H, INTER, generator=g) * 0.05).bfloat16()
    return ops.cpu_prepack_moe_weight(w13, ISA), ops.cpu_prepack_moe_weight(w2, ISA), w13


def run(x, w, ids, w13, w2):
    out = torch.empty_like(x)
    ops.cpu_fused_moe(out, x, w13, w2, None, None, w.float(), ids, "silu", ISA)
    return out


def test_prepack_is_per_expert():
    p13, _, w13 = prepacked()
    one_by_one = torch.cat(
        [ops.cpu_prepack_moe_weight(w13[e : e + 1].contiguous(), ISA) for e in range(E)]
    )
    assert torch.equal(one_by_one, p13)


def test_slot_remap_and_token_groups_are_bit_exact():
    p13, p2, _ = prepacked()
    x, w, ids = random_routing(97, E, K, hidden=H)
    reference = run(x, w, ids, p13, p2)
    # compact, permuted slot pool
    uniq, inverse = ids.unique(return_inverse=True)
    perm = torch.randperm(len(uniq), generator=torch.Generator().manual_seed(3))
    slot_of = torch.empty_like(perm)
    slot_of[perm] = torch.arange(len(uniq))
    pool13, pool2 = p13[uniq[perm]], p2[uniq[perm]]
    remapped = slot_of[inverse].to(ids.dtype)
    assert torch.equal(run(x, w, remapped, pool13, pool2), reference)
    # token groups of every size
    for size in (1, 7):
        parts = [
            run(x[i : i + size], w[i : i + size], ids[i : i + size], p13, p2)
            for i in range(0, len(x), size)
        ]
        assert torch.equal(torch.cat(parts), reference)


@pytest.mark.parametrize("num_slots", [4, 9])
def test_fetch_with_vllm_kernel_is_bit_exact(num_slots):
    p13, p2, _ = prepacked()
    loader = make_loader({"w13_weight": p13, "w2_weight": p2}, num_slots=num_slots, top_k=K)

    def kernel(x, w, slot_ids, slots, expert_map, **_):
        assert expert_map is None  # the CPU build maps ids to slots on the host
        return run(x, w, slot_ids, slots["w13_weight"], slots["w2_weight"])

    stats = PhaseStats()
    for step, tokens in enumerate([1, 2, 5, 130]):
        x, w, ids = random_routing(tokens, E, K, hidden=H, seed=step)
        assert torch.equal(run_fetch(loader, x, w, ids, stats, kernel), run(x, w, ids, p13, p2))
    assert stats.misses > 0


def test_masked_entries_add_nothing():
    """Miss policies mask entries by pointing them at one of the token's other experts
    with weight 0; the kernel's result must equal the launch without those entries."""
    p13, p2, _ = prepacked()
    x, w, ids = random_routing(9, E, K, hidden=H, seed=5)
    masked_ids = ids.clone()
    masked_ids[:, 3] = ids[:, 0]
    masked_w = w.clone()
    masked_w[:, 3] = 0
    assert torch.equal(
        run(x, masked_w, masked_ids, p13, p2),
        run(x, w[:, :3].contiguous(), ids[:, :3].contiguous(), p13, p2),
    )


def test_torch_host_kernel_matches_vllm_cpu_kernel():
    """``torch_experts`` (the host kernel on CUDA builds) computes what vLLM's kernel does."""
    from vllm_specexpert.tiers.host import torch_experts

    p13, p2, w13 = prepacked()
    g = torch.Generator().manual_seed(0)
    torch.randn(E, 2 * INTER, H, generator=g)  # same stream as prepacked(): w2 comes second
    w2 = (torch.randn(E, H, INTER, generator=g) * 0.05).bfloat16()
    x, w, ids = random_routing(9, E, K, hidden=H, seed=6)
    expected = run(x, w, ids, p13, p2)
    got = torch_experts(x, w, ids, {"w13_weight": w13, "w2_weight": w2})
    torch.testing.assert_close(got, expected, rtol=0, atol=2**-6 * float(expected.abs().max()))
