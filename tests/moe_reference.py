"""A plain-PyTorch fused-experts kernel for engine tests that do not start vLLM."""

import torch
import torch.nn.functional as F

from vllm_specexpert import layer_call
from vllm_specexpert.config import LinkConfig
from vllm_specexpert.device_runs import device_run_for
from vllm_specexpert.stats import PhaseStats
from vllm_specexpert.tiers.cache import ExpertCache
from vllm_specexpert.tiers.link import CpuLink
from vllm_specexpert.tiers.loader import ExpertLoader
from vllm_specexpert.tiers.store import ExpertStore


def reference_moe(x, topk_weights, topk_ids, w13, w2):
    """sum_k w_k * W2_e (silu(W1_e x) * W3_e x), token by token (row-independent);
    entries with id -1 contribute zero (like vLLM's kernel with an ``expert_map``)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w2.shape[-1]
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if e < 0:
                continue
            h = w13[e].float() @ x[t].float()
            y = w2[e].float() @ (F.silu(h[:inter]) * h[inter:])
            out[t] += topk_weights[t, k].float() * y
    return out.to(x.dtype)


def random_layer(num_experts=16, hidden=32, inter=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g).bfloat16()
    w2 = torch.randn(num_experts, hidden, inter, generator=g).bfloat16()
    return {"w13_weight": w13, "w2_weight": w2}


def random_routing(tokens, num_experts, top_k, hidden=32, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    logits = torch.randn(tokens, num_experts, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k)
    return x, weights, ids.to(torch.int32)


def make_loader(
    tensors, num_slots, top_k, policy="lru", link=None, device_map=False
) -> ExpertLoader:
    """A loader over a fresh cache of one layer (its ``.cache``), on the CPU link.
    ``device_map``: the CUDA way of finding slots (router ids + ``expert_map``)."""
    store = ExpertStore(pin_memory=False)
    experts = store.add_layer("layer", tensors)
    cache = ExpertCache(
        experts, num_slots, top_k, policy, torch.device("cpu"), device_map=device_map
    )
    return ExpertLoader(cache, link or CpuLink(LinkConfig()))


def run_fetch(
    loader: ExpertLoader, x, topk_weights, topk_ids, stats: PhaseStats, kernel=None
) -> torch.Tensor:
    """One layer call under ``fetch`` (the exact path every prefill call takes): the
    executor surveys the cache and runs every entry on the device, loaded on demand."""
    call = layer_call.LayerCall("layer", kernel or slot_kernel, x, topk_weights, topk_ids)
    call = call.on_host(stats)
    return device_run_for().run_all(loader, call)


def slot_kernel(x, topk_weights, ids, slots, expert_map=None, *, out=None, tile_tokens=0):
    """The reference on the slot pool; ``ids`` go through ``expert_map`` when given."""
    if expert_map is not None:
        ids = expert_map[ids.long()]
    return reference_moe(x, topk_weights, ids, slots["w13_weight"], slots["w2_weight"])


def vllm_isa() -> str:
    """The ISA of the CPU experts class vLLM's unquantized-MoE oracle picks on this
    machine: the first of its preference list whose ``_supports_current_device`` holds
    (``amx`` where the CPU has AMX tiles, else ``vec`` on x86)."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
        UnquantizedMoeBackend,
        backend_to_kernel_cls,
    )

    for cls in backend_to_kernel_cls(UnquantizedMoeBackend.CPU):
        if cls._supports_current_device():
            return cls.isa
    raise AssertionError("vLLM has no CPU MoE kernel for this machine")
