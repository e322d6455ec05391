"""OffloadEngine: the per-worker state shared by every offloaded MoE layer.

One engine per worker process holds the slow tier (:class:`ExpertStore`), the link
(:class:`Link`, one copy engine shared by all layers), one :class:`ExpertCache` per MoE
layer, the miss policy and the predictor. It has no vLLM dependency: the vLLM adapter in
``layers/`` hands it host tensors, a kernel callable per layer, and (for prediction) each
layer's successor with that successor's routing.

A decode step through MoE layer l (see ``../shared/DESIGN.md``, "Data flow"):

1. take the prediction made for l at layer l-1, if any; count its recall against the
   router's choice; under ``speculate`` run the predicted routing instead;
2. resolve layer l's missing experts by the miss policy: load them (waiting for
   in-flight prefetches counts as stall), compute them on the host, substitute or drop;
3. predict layer l+1's experts and submit their prefetch to the link;
4. run layer l's experts: the prefetch overlaps this compute and layer l+1's attention.
"""

from __future__ import annotations

import atexit
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_specexpert.cache import ExpertCache
from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.host import HostExperts, HostKernel
from vllm_specexpert.policy import ExpertKernel, MissContext, make_miss_policy
from vllm_specexpert.policy.buddies import BuddyGates, buddy_lists
from vllm_specexpert.predict import (
    LayerState,
    NextLayerRouting,
    Prediction,
    Predictor,
    PrefetchPlanner,
    QuasiHiddenPredictor,
    RouterPredictor,
    worth_threshold,
)
from vllm_specexpert.stats import LayerStats, write_json_atomic
from vllm_specexpert.store import ExpertStore
from vllm_specexpert.transfer import make_link


HOST_POLICIES = ("cpu", "auto", "auto_buddy")
"""Miss policies that compute experts on the host."""
SUBSTITUTING_POLICIES = ("buddy", "auto_buddy", "random")
"""Miss policies that substitute experts (behind the calibrated gates)."""



@dataclass
class LayerInfo:
    top_k: int
    index: int
    """Decoder-layer index in the model (``exact_layers`` refers to it)."""
    next_name: str | None = None
    """The next offloaded MoE layer, once :meth:`OffloadEngine.link_layers` ran."""
    next_routing: NextLayerRouting | None = None
    planner: PrefetchPlanner | None = None
    """Precision of the predictions made for this layer (decides what to prefetch)."""
    window_s: float | None = None
    """Running mean of the time from a prediction for this layer to its use."""
    host_kernel: HostKernel | None = None
    """Fused experts on host tensors (``cpu``/``auto`` miss policies)."""
    coactivation: np.ndarray | None = None
    """``[E, E]`` calibrated co-activation counts (buddy lists)."""
    tae_percentiles: np.ndarray | None = None
    """``[101]`` calibrated percentiles of the Token Activating Entropy (tau)."""
    miss_context: MissContext | None = None
    """What the miss policy consults about this layer in decode passes."""


class OffloadEngine:
    def __init__(self, config: SpecExpertConfig, device: torch.device, rank: int = 0):
        self.config = config
        self.device = device
        self.rank = rank
        self.store = ExpertStore(pin_memory=device.type == "cuda")
        self.link = make_link(config.link, device)
        self.miss_policy = make_miss_policy(config.miss_policy)
        self.caches: dict[str, ExpertCache] = {}
        self.layers: dict[str, LayerInfo] = {}
        self.default_vectors: dict[str, torch.Tensor] = {}
        """Layer name -> ``[E, H]`` default vectors on the device (``quasi_hidden``)."""
        self.residual_scales: dict[str, torch.Tensor] = {}
        """Layer name -> ``[H]`` scale turning s_l back into r_l (``quasi_hidden``)."""
        self.predictor: Predictor | None = None
        self._make_predictor()
        self._predictions: dict[str, Prediction] = {}
        """Layer name -> prediction for it made earlier in the current forward pass."""
        self._last_stats_write = time.monotonic()
        if config.stats_path:
            atexit.register(self.write_stats)

    # ------------------------------------------------------------------ setup

    def add_layer(
        self, name: str, tensors: dict[str, torch.Tensor], top_k: int, index: int = -1,
        host_kernel: HostKernel | None = None,
    ) -> ExpertCache:
        """Move a layer's routed experts into the slow tier and give it a cache.
        ``host_kernel`` computes experts on the store's tensors (``cpu``/``auto``)."""
        self.store.add_layer(name, tensors)
        self.layers[name] = LayerInfo(top_k=top_k, index=index, planner=PrefetchPlanner(top_k),
                                      host_kernel=host_kernel)
        self.caches[name] = self._make_cache(name)
        self._make_miss_context(name)
        return self.caches[name]

    def link_layers(self, name: str, next_name: str, routing: NextLayerRouting) -> None:
        """Declare ``next_name`` as the MoE layer after ``name`` and how it routes, so
        that ``name`` can predict and prefetch for it."""
        self.layers[name].next_name = next_name
        self.layers[name].next_routing = routing

    def set_quasi_hidden(self, default_vectors: dict[str, torch.Tensor],
                         residual_scales: dict[str, torch.Tensor]) -> None:
        """Per layer name: default vectors and residual scales from a calibration (see
        :mod:`vllm_specexpert.predict.quasi_hidden`)."""
        self.default_vectors = {n: v.to(self.device) for n, v in default_vectors.items()}
        self.residual_scales = {n: v.to(self.device) for n, v in residual_scales.items()}
        self._make_predictor()

    def set_routing_statistics(self, coactivation: dict[str, np.ndarray],
                               tae_percentiles: dict[str, np.ndarray]) -> None:
        """Per layer name: calibrated co-activation counts and TAE percentiles (see
        :mod:`vllm_specexpert.policy.buddies`)."""
        for name, info in self.layers.items():
            info.coactivation = np.asarray(coactivation[name])
            info.tae_percentiles = np.asarray(tae_percentiles[name], dtype=np.float64)
            self._make_miss_context(name)

    def _make_miss_context(self, name: str) -> None:
        """The miss policy's view of a layer; raises a config error when the policy
        needs what the layer does not have."""
        info, cache, config = self.layers[name], self.caches[name], self.config
        policy = config.miss_policy
        context = MissContext(copy_seconds=self.link.expert_seconds(cache.experts))
        if policy in HOST_POLICIES:
            if info.host_kernel is None:
                raise SpecExpertConfigError(
                    "miss_policy", f"'{policy}' needs a host kernel, and layer {name} has none",
                    "use 'fetch' (this layer type cannot compute experts on the host)")
            link = config.link
            context.host = HostExperts(cache.experts, info.host_kernel,
                                       link.host_slowdown if link.emulated else None)
            context.admit_host_experts = config.admit_host_experts
        if policy in SUBSTITUTING_POLICIES:
            buddy = config.buddy
            tau = buddy.tau
            if config.needs_routing_statistics:
                if info.coactivation is None:  # the adapter sets them at load time
                    return
                if policy != "random":
                    context.buddies = buddy_lists(info.coactivation, buddy.alpha, buddy.k_max)
                if tau is None:
                    tau = float(np.interp(buddy.tau_percentile, np.linspace(0, 100, 101),
                                          info.tae_percentiles))
            context.gates = BuddyGates(tau=tau, beta=buddy.beta, rho=buddy.rho)
        info.miss_context = context

    def check_ready(self) -> None:
        """Once every layer is loaded and wired: fail at engine start, not mid-generation,
        when the miss policy lacks its calibration data."""
        for name, info in self.layers.items():
            if info.miss_context is None:
                raise SpecExpertConfigError(
                    "calibration", f"miss_policy '{self.config.miss_policy}' needs the "
                    "calibration's co-activation counts and TAE percentiles, and layer "
                    f"{name} has none",
                    "set 'calibration' to a directory from `specexpert calibrate` for this model")

    def _make_predictor(self) -> None:
        if self.config.predictor == "router":
            self.predictor = RouterPredictor()
        elif self.config.predictor == "quasi_hidden":
            self.predictor = QuasiHiddenPredictor(self.default_vectors, self.residual_scales)
        else:
            self.predictor = None

    def _make_cache(self, name: str) -> ExpertCache:
        experts = self.store.layers[name]
        top_k = self.layers[name].top_k
        num_slots = self.config.slots_per_layer(experts.num_experts, top_k)
        return ExpertCache(experts, num_slots, top_k, self.config.cache, self.device, self.link)

    def reconfigure(self, config: SpecExpertConfig) -> None:
        """Switch budget, cache policy, miss policy, predictor or link without reloading
        weights. Every cache is rebuilt (warm start again) and the counters restart.
        A ``quasi_hidden`` predictor needs default vectors already set (the adapter
        loads them at start-up when ``calibration`` is configured)."""
        for name, experts in self.store.layers.items():  # validate before changing
            config.slots_per_layer(experts.num_experts, self.layers[name].top_k)
        if config.calibration != self.config.calibration:
            raise SpecExpertConfigError(
                "calibration", "is read when the model loads and cannot change at run time",
                "start a new engine with the new 'calibration'",
            )
        if config.miss_policy in HOST_POLICIES and any(
            info.host_kernel is None for info in self.layers.values()
        ):
            raise SpecExpertConfigError(
                "miss_policy", f"'{config.miss_policy}' needs a host kernel, and a layer has none",
                "use 'fetch' (this layer type cannot compute experts on the host)")
        if config.needs_routing_statistics and any(
            info.coactivation is None for info in self.layers.values()
        ):
            raise SpecExpertConfigError(
                "calibration", f"miss_policy '{config.miss_policy}' needs the calibration's "
                "routing statistics, loaded at engine start", "start the engine with 'calibration' set")
        if config.predictor == "quasi_hidden" and not self.default_vectors:
            raise SpecExpertConfigError(
                "predictor", "quasi_hidden needs the calibration loaded at engine start",
                "start the engine with 'calibration' set",
            )
        self.link.close()
        self.config = config
        self.link = make_link(config.link, self.device)
        self.miss_policy = make_miss_policy(config.miss_policy)
        self._make_predictor()
        self._predictions.clear()
        for info in self.layers.values():
            info.planner, info.window_s = PrefetchPlanner(info.top_k), None
        self.caches = {}  # free the old pools before allocating the new ones
        for name in self.store.layers:
            self.caches[name] = self._make_cache(name)
            self._make_miss_context(name)
        self.check_ready()
        self.reset_stats()

    # ---------------------------------------------------------------- forward

    def run(
        self,
        name: str,
        kernel: ExpertKernel,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Routed-expert output of layer ``name`` for a token batch."""
        cache = self.caches[name]
        info = self.layers[name]
        prediction = self._predictions.pop(name, None)
        if prediction is not None and prediction.num_tokens != x.shape[0]:
            prediction = None
        if prediction is not None:
            self._observe(info, cache.stats, prediction, topk_ids)
            if self._speculative(info):
                routed_ids = topk_ids
                topk_weights, topk_ids = self.miss_policy.routing(topk_weights, topk_ids, prediction)
                cache.stats.speculated_calls += topk_ids is not routed_ids

        before_kernel = None
        if (
            self.predictor is not None
            and info.next_name is not None
            and x.shape[0] <= self.config.max_decode_tokens
        ):
            state = LayerState(x, topk_ids, topk_weights)

            def before_kernel() -> None:
                self._predict_and_prefetch(name, info, state)

        context = info.miss_context if x.shape[0] <= self.config.max_decode_tokens else None
        if context is not None:
            context.copy_seconds = self.link.expert_seconds(cache.experts)
        out = self.miss_policy.run(cache, kernel, x, topk_weights, topk_ids, before_kernel,
                                   context)
        if self.config.stats_path:
            now = time.monotonic()
            if now - self._last_stats_write >= self.config.stats_interval_s:
                self._last_stats_write = now
                self.write_stats()
        return out

    def _speculative(self, info: LayerInfo) -> bool:
        exact_layers = self.config.exact_layers
        if exact_layers is None:
            return True  # the first MoE layer never has a prediction
        return info.index not in exact_layers

    def _predict_and_prefetch(self, name: str, info: LayerInfo, state: LayerState) -> None:
        prediction = self.predictor.predict(state, name, info.next_routing)
        prediction.made_at = time.perf_counter()
        self._predictions[info.next_name] = prediction
        nxt = self.layers[info.next_name]
        cache = self.caches[info.next_name]
        # On CUDA, reading the prediction on the host waits for the compute stream (the
        # predictor's router GEMM): the host decides what to copy.
        if self.config.prefetch_filter == "all" or (
            self.miss_policy.name == "speculate" and self._speculative(nxt)
        ):
            cache.prefetch(prediction.experts_by_mass())  # every predicted expert runs
            return
        ranked = prediction.ranked()
        prediction.considered = cache.expert_slot[ranked] < 0
        copy_s = self.link.expert_seconds(cache.experts)
        threshold = worth_threshold(copy_s, nxt.window_s if nxt.window_s is not None else copy_s)
        wanted, skipped = nxt.planner.plan(ranked, threshold)
        cache.stats.prefetch_skipped += int(np.count_nonzero(cache.expert_slot[skipped] < 0))
        cache.prefetch(wanted)

    def _observe(self, info: LayerInfo, stats: LayerStats, prediction: Prediction,
                 topk_ids: torch.Tensor) -> None:
        """Score the prediction made for this layer against its router's choice."""
        window = time.perf_counter() - prediction.made_at
        info.window_s = window if info.window_s is None else 0.9 * info.window_s + 0.1 * window
        stats.predicted += topk_ids.numel()
        stats.predicted_correct += info.planner.observe(
            prediction.ranked(), topk_ids.cpu().numpy(), prediction.considered)

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
            "predictor": self.config.predictor,
            "exact": self.config.exact,
            "output": self.config.output,
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
