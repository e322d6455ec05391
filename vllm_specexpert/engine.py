"""OffloadEngine: the per-worker state shared by every offloaded MoE layer.

One engine per worker process holds the slow tier (:class:`ExpertStore`), the link
(:class:`Link`, one copy engine shared by all layers), one :class:`ExpertCache` per MoE
layer, and the miss policy. It has no vLLM dependency: the vLLM adapter in ``layers/``
hands it host tensors and a kernel callable.
"""

from __future__ import annotations

import atexit
import time
from typing import Any

import torch

from vllm_specexpert.cache import ExpertCache
from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.policy import ExpertKernel, make_miss_policy
from vllm_specexpert.stats import LayerStats, write_json_atomic
from vllm_specexpert.store import ExpertStore
from vllm_specexpert.transfer import make_link


class OffloadEngine:
    def __init__(self, config: SpecExpertConfig, device: torch.device, rank: int = 0):
        self.config = config
        self.device = device
        self.rank = rank
        self.store = ExpertStore(pin_memory=device.type == "cuda")
        self.link = make_link(config.link, device)
        self.miss_policy = make_miss_policy(config.miss_policy)
        self.caches: dict[str, ExpertCache] = {}
        self._top_k: dict[str, int] = {}
        self._last_stats_write = time.monotonic()
        if config.stats_path:
            atexit.register(self.write_stats)

    def add_layer(self, name: str, tensors: dict[str, torch.Tensor], top_k: int) -> ExpertCache:
        """Move a layer's routed experts into the slow tier and give it a cache."""
        experts = self.store.add_layer(name, tensors)
        self._top_k[name] = top_k
        self.caches[name] = self._make_cache(name)
        return self.caches[name]

    def _make_cache(self, name: str) -> ExpertCache:
        experts = self.store.layers[name]
        top_k = self._top_k[name]
        num_slots = self.config.slots_per_layer(experts.num_experts, top_k)
        return ExpertCache(experts, num_slots, top_k, self.config.cache, self.device, self.link)

    def reconfigure(self, config: SpecExpertConfig) -> None:
        """Switch budget, cache policy, miss policy or link without reloading weights.
        Every cache is rebuilt (warm start again) and the counters restart."""
        for name, experts in self.store.layers.items():  # validate before changing
            config.slots_per_layer(experts.num_experts, self._top_k[name])
        self.link.close()
        self.config = config
        self.link = make_link(config.link, self.device)
        self.miss_policy = make_miss_policy(config.miss_policy)
        self.caches = {}  # free the old pools before allocating the new ones
        for name in self.store.layers:
            self.caches[name] = self._make_cache(name)

    def run(
        self,
        name: str,
        kernel: ExpertKernel,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Routed-expert output of layer ``name`` for a token batch."""
        out = self.miss_policy.run(self.caches[name], kernel, x, topk_weights, topk_ids)
        if self.config.stats_path:
            now = time.monotonic()
            if now - self._last_stats_write >= self.config.stats_interval_s:
                self._last_stats_write = now
                self.write_stats()
        return out

    # ---------------------------------------------------------------- statistics

    def stats(self) -> dict[str, Any]:
        """Per-layer counters, totals, link counters and the configuration."""
        layers = {name: cache.stats for name, cache in self.caches.items()}
        total = LayerStats()
        for s in layers.values():
            for key, value in vars(s).items():
                if key == "max_resident":
                    total.max_resident = max(total.max_resident, value)
                else:
                    setattr(total, key, getattr(total, key) + value)
        return {
            "rank": self.rank,
            "device": str(self.device),
            "miss_policy": self.miss_policy.name,
            "exact": self.miss_policy.exact,
            "config": self.config.to_dict(),
            "slots_per_layer": {n: c.num_slots for n, c in self.caches.items()},
            "experts_per_layer": {n: c.num_experts for n, c in self.caches.items()},
            "expert_bytes": {n: c.experts.expert_nbytes for n, c in self.caches.items()},
            "store_bytes": self.store.nbytes,
            "link": {
                "bytes": self.link.bytes_copied,
                "copies": self.link.copies,
                "stall_s": self.link.stall_s,
            },
            "total": total.to_dict(),
            "layers": {name: s.to_dict() for name, s in layers.items()},
        }

    def reset_stats(self) -> None:
        for cache in self.caches.values():
            cache.reset_stats()
        self.link.bytes_copied = 0
        self.link.copies = 0
        self.link.stall_s = 0.0

    def write_stats(self) -> None:
        if self.config.stats_path:
            path = self.config.stats_path.replace("{rank}", str(self.rank))
            write_json_atomic(path, self.stats())

    def close(self) -> None:
        self.link.close()
