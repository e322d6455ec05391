"""OffloadEngine: the per-worker state shared by every offloaded MoE layer.

One engine per worker process holds the slow tier (:class:`ExpertStore`), the link
(:class:`Link`, one copy engine shared by all layers), per MoE layer an
:class:`ExpertCache` (residency) with its :class:`ExpertLoader` (copies in flight) and
counters, the miss policy and the predictor. It has no vLLM dependency: the vLLM adapter
in ``layers/`` hands it host tensors, a kernel callable per layer, each layer's successor
with that successor's routing, and per forward pass which tokens are decode
(:class:`PassPhases`).

A layer call splits its tokens by phase. Prefill tokens run exactly: the router's
experts, loaded on demand. Decode tokens go through the modes (see
``../shared/DESIGN.md``, "Data flow"):

1. take the prediction made for layer l at layer l-1, if any; count its recall against
   the router's choice; under ``speculate`` run the predicted routing instead;
2. resolve layer l's missing experts by the miss policy: load them (waiting for
   in-flight prefetches counts as stall), compute them on the host, substitute or drop;
3. predict layer l+1's experts and submit their prefetch to the link;
4. run layer l's experts: the prefetch overlaps this compute and layer l+1's attention.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_specexpert import metrics
from vllm_specexpert.cache import ExpertCache, SlotPool
from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.host import HostExperts, HostKernel
from vllm_specexpert.loader import ExpertLoader
from vllm_specexpert.log import init_logger
from vllm_specexpert.phases import PassPhases, StepDemand
from vllm_specexpert.policy import ExpertKernel, MissContext, MissPolicy, run_layer_call
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
from vllm_specexpert.staging import HostReader, upload
from vllm_specexpert.stats import LayerStats, PhaseStats, StatsWriter, check_stats_path
from vllm_specexpert.store import ExpertStore
from vllm_specexpert.transfer import make_link

logger = init_logger(__name__)


@dataclass
class OffloadedLayer:
    """One offloaded MoE layer: its cache, loader, counters and wiring."""

    name: str
    top_k: int
    index: int
    """Decoder-layer index in the model (``exact_layers`` refers to it)."""
    cache: ExpertCache
    loader: ExpertLoader
    stats: LayerStats = field(default_factory=LayerStats)
    host_kernel: HostKernel | None = None
    """Fused experts on host tensors (``cpu``/``auto`` miss policies)."""
    next_name: str | None = None
    """The next offloaded MoE layer, once :meth:`OffloadEngine.link_layers` ran."""
    next_routing: NextLayerRouting | None = None
    planner: PrefetchPlanner | None = None
    """Precision of the predictions made for this layer (decides what to prefetch)."""
    window_s: float | None = None
    """Running mean of the time from a prediction for this layer to its use."""
    coactivation: np.ndarray | None = None
    """``[E, E]`` calibrated co-activation counts (buddy lists)."""
    tae_percentiles: np.ndarray | None = None
    """``[101]`` calibrated percentiles of the Token Activating Entropy (tau)."""
    miss_context: MissContext | None = None
    """What the miss policy consults about this layer for decode tokens."""


class OffloadEngine:
    def __init__(self, config: SpecExpertConfig, device: torch.device, rank: int = 0):
        self.config = config
        self.device = device
        self.rank = rank
        self.store = ExpertStore(pin_memory=device.type == "cuda")
        self.link = make_link(config.link, device)
        self.reader = HostReader(device)
        """One device->host read per decode layer call (router ids + prediction)."""
        self.step_demand: StepDemand | None = None
        """The running step's predicted demand from the scheduler's path predictor (set
        by the vLLM adapter per layer call; ``None`` without one)."""
        self.pool: SlotPool | None = self._make_pool(config)
        """The slot pool every layer shares (``cache: plec``); ``None``: one per layer."""
        self._planned_step: StepDemand | None = None
        """The step demand the shared pool was last planned for."""
        self.miss_policy: MissPolicy = config.miss_policy_class()
        self.layers: dict[str, OffloadedLayer] = {}
        self.default_vectors: dict[str, torch.Tensor] = {}
        """Layer name -> ``[E, H]`` default vectors on the device (``quasi_hidden``)."""
        self.residual_scales: dict[str, torch.Tensor] = {}
        """Layer name -> ``[H]`` scale turning s_l back into r_l (``quasi_hidden``)."""
        self.predictor: Predictor | None = self._make_predictor(config)
        self._predictions: dict[str, Prediction] = {}
        """Layer name -> prediction for its decode tokens made earlier in the pass."""
        self._lock = threading.Lock()
        """Held while the layers change (reconfigure) or are read by another thread."""
        self._stats_writer: StatsWriter | None = None
        self._metrics_writer: StatsWriter | None = None
        """Snapshots for the server's ``/metrics`` (:mod:`vllm_specexpert.metrics`)."""

    # ------------------------------------------------------------------ setup

    def add_layer(
        self, name: str, tensors: dict[str, torch.Tensor], top_k: int, index: int = -1,
        host_kernel: HostKernel | None = None,
    ) -> OffloadedLayer:
        """Move a layer's routed experts into the slow tier and give it a cache.
        ``host_kernel`` computes experts on the store's tensors (``cpu``/``auto``)."""
        self.store.add_layer(name, tensors)
        cache = self._make_cache(name, top_k)
        layer = OffloadedLayer(name=name, top_k=top_k, index=index, cache=cache,
                               loader=ExpertLoader(cache, self.link),
                               planner=PrefetchPlanner(top_k), host_kernel=host_kernel)
        self.layers[name] = layer
        self._make_miss_context(layer, self.config)
        return layer

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
        self.predictor = self._make_predictor(self.config)

    def set_routing_statistics(self, coactivation: dict[str, np.ndarray],
                               tae_percentiles: dict[str, np.ndarray]) -> None:
        """Per layer name: calibrated co-activation counts and TAE percentiles (see
        :mod:`vllm_specexpert.policy.buddies`)."""
        for name, layer in self.layers.items():
            layer.coactivation = np.asarray(coactivation[name])
            layer.tae_percentiles = np.asarray(tae_percentiles[name], dtype=np.float64)
            self._make_miss_context(layer, self.config)

    def start(self) -> None:
        """Every layer is loaded and wired: check that the configuration can run (fail
        at engine start, not mid-generation), allocate a shared slot pool, start the
        stats writer, and log one line that sums up the offload."""
        self._check_runnable(self.config)
        if self.pool is not None and not self.pool.tensors:
            self.pool.allocate()
        self._start_stats_writer()
        logger.info("specexpert: %s", self.summary())

    def _start_stats_writer(self) -> None:
        if self._stats_writer is not None:
            self._stats_writer.close()
            self._stats_writer = None
        directory = os.environ.get(metrics.DIRECTORY_ENV)
        if directory and self._metrics_writer is None:
            model_name = os.environ.get(metrics.MODEL_NAME_ENV, "")
            self._metrics_writer = StatsWriter(
                metrics.snapshot_path(directory), metrics.SNAPSHOT_INTERVAL_S,
                lambda: {**self.stats(), "model_name": model_name},
                what="metrics snapshot", write_last=False)
        if self.config.stats_path:
            check_stats_path(self.stats_file)
            self._stats_writer = StatsWriter(self.stats_file, self.config.stats_interval_s,
                                             self.stats)

    def summary(self) -> str:
        """One line: MoE layers, slots per layer, slow tier, policy, predictor."""
        slots = sorted({layer.cache.num_slots for layer in self.layers.values()})
        experts = sorted({layer.cache.num_experts for layer in self.layers.values()})
        config = self.config
        link = config.link
        modeled = (f", emulated link {link.bandwidth_gbps:g} GB/s + {link.latency_us:g} us/copy,"
                   f" host_slowdown {link.host_slowdown:g}" if link.emulated else "")
        residency = (f"{'/'.join(map(str, slots))} of {'/'.join(map(str, experts))} "
                     "experts resident per layer")
        if self.pool is not None:
            residency = (f"one pool of {sum(la.cache.num_slots for la in self.layers.values())}"
                         f" slots shared by their {'/'.join(map(str, experts))} experts each")
        return (
            f"{len(self.layers)} MoE layers offloaded, {residency}; slow tier "
            f"{self.store.nbytes / 1e9:.3f} GB on the host"
            f"{' (pinned)' if self.store.pin_memory else ''}; miss_policy {config.miss_policy} "
            f"({self.output}), predictor {config.predictor}, cache {config.cache}"
            f"{modeled}"
        )

    @property
    def output(self) -> str:
        """What the running mode does to the model's output (see ``MissPolicy.output``).
        On CUDA an ``exact`` policy is reported ``equivalent``: the router's ids reach
        vLLM's Triton kernel unchanged, with vanilla's tile config for the whole call,
        so each token's sums run in vanilla's order as long as a GEMM row does not
        depend on the other rows of its tile (no split-K in fused MoE), but that has
        not been checked on a GPU (``make gpu-check`` compares greedy outputs)."""
        output = self.miss_policy.output
        if output == "exact" and self.device.type != "cpu":
            return "equivalent"
        return output

    def _check_runnable(self, config: SpecExpertConfig) -> None:
        """Raise a config error when ``config`` needs what the loaded layers lack."""
        policy = config.miss_policy_class
        if policy.computes_on_host and any(
            layer.host_kernel is None for layer in self.layers.values()
        ):
            raise SpecExpertConfigError(
                "miss_policy", f"'{policy.name}' computes experts on the host, and this "
                "model's expert layers have no host kernel",
                "use 'fetch' (this layer type cannot compute experts on the host)")
        if config.needs_routing_statistics and any(
            layer.coactivation is None for layer in self.layers.values()
        ):
            raise SpecExpertConfigError(
                "calibration", f"miss_policy '{policy.name}' needs the calibration's "
                "co-activation counts and TAE percentiles, loaded at engine start",
                "start the engine with 'calibration' set to a directory from "
                "`specexpert calibrate` for this model")
        moe_layers = sorted(layer.index for layer in self.layers.values())
        unknown = sorted(set(config.exact_layers or ()) - set(moe_layers))
        if unknown:
            raise SpecExpertConfigError(
                "exact_layers", f"{unknown} are not MoE layers of this model",
                f"give indices among its MoE layers {moe_layers}")
        if config.predictor == "quasi_hidden" and not self.default_vectors:
            raise SpecExpertConfigError(
                "predictor", "quasi_hidden needs the calibration's default vectors, loaded "
                "at engine start", "start the engine with 'calibration' set")

    def _make_miss_context(self, layer: OffloadedLayer, config: SpecExpertConfig) -> None:
        """The miss policy's view of a layer (left unset while something it needs is
        missing: :meth:`start` reports it)."""
        policy = config.miss_policy_class
        context = MissContext(copy_seconds=self.link.expert_seconds(layer.cache.experts))
        if policy.computes_on_host:
            if layer.host_kernel is None:
                return
            link = config.link
            context.host = HostExperts(layer.cache.experts, layer.host_kernel,
                                       link.host_slowdown if link.emulated else None)
            context.admit_host_experts = config.admit_host_experts
        if policy.substitutes:
            buddy = config.buddy
            tau = buddy.tau
            if config.needs_routing_statistics:
                if layer.coactivation is None:  # the adapter sets them at load time
                    return
                if policy.uses_buddy_lists:
                    context.buddies = buddy_lists(layer.coactivation, buddy.alpha, buddy.k_max)
                if tau is None:
                    tau = float(np.interp(buddy.tau_percentile, np.linspace(0, 100, 101),
                                          layer.tae_percentiles))
            context.gates = BuddyGates(tau=tau, beta=buddy.beta, rho=buddy.rho)
        layer.miss_context = context

    def _make_predictor(self, config: SpecExpertConfig) -> Predictor | None:
        if config.predictor == "router":
            return RouterPredictor()
        if config.predictor == "quasi_hidden":
            return QuasiHiddenPredictor(self.default_vectors, self.residual_scales)
        return None

    def _make_pool(self, config: SpecExpertConfig) -> SlotPool | None:
        return SlotPool(self.device, shared=True) if config.cache == "plec" else None

    def _make_cache(self, name: str, top_k: int) -> ExpertCache:
        """Layer ``name``'s cache: its own pool, or its share of the shared one (which
        :meth:`start` allocates once every layer joined)."""
        experts = self.store.layers[name]
        num_slots = self.config.slots_per_layer(experts.num_experts, top_k)
        if self.pool is None:
            return ExpertCache(experts, num_slots, top_k, self.config.cache, self.device)
        try:
            return ExpertCache(experts, num_slots, top_k, "lru", self.device, pool=self.pool)
        except ValueError as error:
            raise SpecExpertConfigError(
                "cache", f"'plec' shares one slot pool between layers: {error}",
                "use cache 'lru'") from error

    def reconfigure(self, config: SpecExpertConfig) -> None:
        """Switch budget, cache policy, miss policy, predictor or link without reloading
        weights. Every cache is rebuilt (warm start again) and the counters restart.
        Everything is checked before anything changes."""
        for layer in self.layers.values():
            config.slots_per_layer(layer.cache.num_experts, layer.top_k)
        for name in ("calibration", "path_predictor", "token_scheduler"):
            if getattr(config, name) != getattr(self.config, name):
                raise SpecExpertConfigError(
                    name, "is read when the engine starts and cannot change at run time",
                    f"start a new engine with the new '{name}'")
        self._check_runnable(config)
        self._rebuild(config)
        logger.info("specexpert: reconfigured: %s", self.summary())

    def restart(self) -> None:
        """Back to the state of engine start: caches warm-started, no prediction or copy
        pending, counters at zero. vLLM's profile and warm-up passes run the layers on
        uninitialized memory before serving (compiled mode); what they loaded would
        decide the first requests' hits, and the output of the approximate miss
        policies would differ from run to run. The plugin calls this once vLLM's warm-up
        is over (:func:`vllm_specexpert.plugins.register`)."""
        self._rebuild(self.config)

    def _rebuild(self, config: SpecExpertConfig) -> None:
        """Every cache rebuilt for ``config`` (warm start), a new link, counters at zero."""
        with self._lock:
            for layer in self.layers.values():
                layer.loader.wait_all()  # nothing is freed while a copy into it runs
            self.link.close()
            self.config = config
            self.link = make_link(config.link, self.device)
            self.miss_policy = config.miss_policy_class()
            self.predictor = self._make_predictor(config)
            self._predictions.clear()
            for layer in self.layers.values():
                layer.cache = layer.loader = None  # free the old pools before the new ones
            self.pool, self._planned_step = self._make_pool(config), None
            for layer in self.layers.values():
                layer.cache = self._make_cache(layer.name, layer.top_k)
                layer.loader = ExpertLoader(layer.cache, self.link)
                layer.planner, layer.window_s = PrefetchPlanner(layer.top_k), None
                layer.stats = LayerStats()
                self._make_miss_context(layer, config)
            if self.pool is not None:
                self.pool.allocate()
        self.link.reset_counters()
        self._start_stats_writer()

    # ---------------------------------------------------------------- forward

    def run(
        self,
        name: str,
        kernel: ExpertKernel,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        phases: PassPhases | None = None,
    ) -> torch.Tensor:
        """Routed-expert output of layer ``name`` for a pass's tokens. ``phases`` says
        which rows are decode tokens (default: all)."""
        layer = self.layers[name]
        if x.shape[0] == 1 and layer.cache.identity and self.predictor is None:
            return self._run_resident_token(layer, kernel, x, topk_weights, topk_ids, phases)
        if phases is None or phases.all_decode:
            return self._run_decode(layer, kernel, x, topk_weights, topk_ids)
        if phases.all_prefill:
            return self._run_prefill(layer, kernel, x, topk_weights, topk_ids)
        # A mixed pass (chunked prefill beside decoding requests): decode rows first, so
        # that their prefetched experts are released by their own call.
        out = torch.empty_like(x)
        for rows, run in ((phases.decode, self._run_decode),
                          (phases.prefill, self._run_prefill)):
            index = upload(rows, x.device)
            out[index] = run(layer, kernel, x[index], topk_weights[index], topk_ids[index])
        return out

    def _run_resident_token(self, layer: OffloadedLayer, kernel: ExpertKernel,
                            x: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor, phases: PassPhases | None) -> torch.Tensor:
        """One token on a layer whose every expert is resident (budget 1.0), with no
        prediction to make: nothing to decide, so nothing is read to the host. Its
        top-k experts are distinct, all hits."""
        phase = layer.stats.prefill if phases is not None and phases.all_prefill \
            else layer.stats.decode
        stats = self._count_call(layer, phase, x)
        stats.requests += layer.top_k
        stats.hits += layer.top_k
        stats.experts_needed += layer.top_k
        stats.kernel_calls += 1
        kernel_ids, expert_map = layer.cache.kernel_routing(topk_ids, None)
        return kernel(x, topk_weights, kernel_ids, layer.cache.slots, expert_map)

    def _run_prefill(self, layer: OffloadedLayer, kernel: ExpertKernel, x: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Prefill tokens: the router's experts, loaded on demand (exact)."""
        self._count_call(layer, layer.stats.prefill, x)
        return run_layer_call(self.miss_policy, layer.loader, kernel, x, topk_weights, topk_ids)

    def _run_decode(self, layer: OffloadedLayer, kernel: ExpertKernel, x: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Decode tokens: prediction, prefetch and the miss policy (module doc)."""
        stats = self._count_call(layer, layer.stats.decode, x)
        prediction = self._predictions.pop(layer.name, None)
        if prediction is not None and prediction.num_tokens != x.shape[0]:
            prediction = None
        run_weights, run_ids = topk_weights, topk_ids
        speculated = (prediction is not None and self.miss_policy.speculates
                      and self._speculative(layer))
        if speculated:
            run_weights, run_ids = self.miss_policy.routing(topk_weights, topk_ids, prediction)
            stats.speculated_calls += 1
        # The next layer's prediction is made now, on the device, so that its ids come
        # to the host in the same read as the router's; its prefetch is submitted once
        # this layer's own loads are (before_kernel).
        upcoming = None
        if self.predictor is not None and layer.next_name is not None:
            upcoming = self.predictor.predict(LayerState(x, run_ids, run_weights), layer.name,
                                              layer.next_routing)
        host = self.reader.read([topk_ids, *(upcoming.device_reads() if upcoming else ())])
        if upcoming is not None:
            upcoming.set_host(host[1], host[2])
        if prediction is not None:
            self._observe(layer, stats, prediction, host[0])
        demand = self.step_demand
        if demand is not None and (demand.tokens != x.shape[0]
                                   or layer.index not in demand.layers):
            demand = None  # not this pass's decode tokens
        if demand is not None:
            used = np.unique(host[0])
            stats.path_needed += len(used)
            stats.path_covered += int(np.count_nonzero(demand.layers[layer.index][used]))
            if self.pool is not None and demand is not self._planned_step:
                self._plan_step(demand, layer)

        before_kernel = None
        if upcoming is not None:
            def before_kernel() -> None:
                self._prefetch(layer, upcoming)

        context = layer.miss_context
        context.copy_seconds = self.link.expert_seconds(layer.cache.experts)
        out = run_layer_call(self.miss_policy, layer.loader, kernel, x, run_weights,
                             run_ids, before_kernel, context,
                             ids=prediction.host_ids if speculated else host[0])
        if demand is not None and self.pool is not None:
            self._plan_after(layer, demand)
        return out

    @staticmethod
    def _count_call(layer: OffloadedLayer, stats: PhaseStats, x: torch.Tensor) -> PhaseStats:
        layer.loader.stats = stats
        stats.calls += 1
        stats.tokens += x.shape[0]
        return stats

    def _speculative(self, layer: OffloadedLayer) -> bool:
        exact_layers = self.config.exact_layers
        if exact_layers is None:
            return True  # the first MoE layer never has a prediction
        return layer.index not in exact_layers

    def _prefetch(self, layer: OffloadedLayer, prediction: Prediction) -> None:
        """Record ``prediction`` for the next layer and submit its prefetch."""
        prediction.made_at = time.perf_counter()  # the prefetch's window starts now
        self._predictions[layer.next_name] = prediction
        nxt = self.layers[layer.next_name]
        nxt.loader.stats = nxt.stats.decode  # predictions are made for decode tokens only
        cache = nxt.cache
        if self.config.prefetch_filter == "all" or (
            self.miss_policy.speculates and self._speculative(nxt)
        ):
            nxt.loader.prefetch(prediction.experts_by_mass())  # every predicted expert runs
            return
        ranked = prediction.ranked()
        prediction.considered = cache.expert_slot[ranked] < 0
        copy_s = self.link.expert_seconds(cache.experts)
        threshold = worth_threshold(copy_s, nxt.window_s if nxt.window_s is not None else copy_s)
        wanted, skipped = nxt.planner.plan(ranked, threshold)
        nxt.stats.decode.prefetch_skipped += int(np.count_nonzero(cache.expert_slot[skipped] < 0))
        nxt.loader.prefetch(wanted)

    def _plan_step(self, demand: StepDemand, first: OffloadedLayer) -> None:
        """A step starts at layer ``first`` (``plec``): its predicted demand becomes
        every layer's lookahead, and (``plec_preload``) the predicted experts of the
        layers after ``first`` (whose router has already chosen) are loaded, the nearest
        layers' first and each layer's most demanded first, into the slots that hold
        nothing predicted."""
        self._planned_step = demand
        pool = self.pool
        for layer in self.layers.values():
            row = demand.layers.get(layer.index)
            pool.lookahead[layer.cache.index] = 0 if row is None else row
        if self.config.plec_preload != "none":
            later = list(self.layers.values())
            self._preload(later[later.index(first) + 1:])

    def _plan_after(self, layer: OffloadedLayer, demand: StepDemand) -> None:
        """Layer ``layer`` ran its step (``plec``): what it will be asked next is the
        group the token scheduler runs next step, whose predicted experts become its
        lookahead and (``plec_preload: next``) are loaded now (group g+1's loads overlap
        group g's compute). Without such a prediction the same
        requests run next, and the step's demand stays as the lookahead."""
        if demand.next_layers is None:
            return
        row = demand.next_layers.get(layer.index)
        self.pool.lookahead[layer.cache.index] = 0 if row is None else row
        if self.config.plec_preload == "next":
            self._preload([layer])

    def _preload(self, layers) -> None:
        """Load the predicted, non-resident experts of ``layers`` (in that order, most
        predicted uses first) into the pool's spare slots."""
        pool = self.pool
        room = pool.spare()
        for layer in layers:
            if room <= 0:
                return
            row = pool.lookahead[layer.cache.index]
            wanted = np.flatnonzero((row > 0) & (layer.cache.expert_slot < 0))
            wanted = wanted[np.argsort(-row[wanted], kind="stable")][:room]
            layer.loader.stats = layer.stats.decode
            layer.loader.preload(wanted)
            room -= len(wanted)

    def _observe(self, layer: OffloadedLayer, stats: PhaseStats, prediction: Prediction,
                 router_ids: np.ndarray) -> None:
        """Score the prediction made for this layer against its router's choice."""
        window = time.perf_counter() - prediction.made_at
        layer.window_s = window if layer.window_s is None else 0.9 * layer.window_s + 0.1 * window
        stats.predicted += router_ids.size
        stats.predicted_correct += layer.planner.observe(
            prediction.ranked(), router_ids, prediction.considered)

    # ---------------------------------------------------------------- statistics

    @property
    def stats_file(self) -> str | None:
        path = self.config.stats_path
        return path.replace("{rank}", str(self.rank)) if path else None

    def stats(self) -> dict[str, Any]:
        """Per-layer counters by phase, their totals, link counters and the
        configuration. Safe to call from another thread."""
        with self._lock:
            layers = {name: layer.stats for name, layer in self.layers.items()}
            total = LayerStats.sum(layers.values())
            first = next(iter(layers.values()), LayerStats())
            link = self.config.link
            return {
                "rank": self.rank,
                "device": str(self.device),
                "miss_policy": self.miss_policy.name,
                "predictor": self.config.predictor,
                "output": self.output,
                "exact": self.output == "exact",
                "config": self.config.to_dict(),
                "summary": self.summary(),
                "decode_tokens": first.decode.tokens,
                "prefill_tokens": first.prefill.tokens,
                "layer_index": {n: la.index for n, la in self.layers.items()},
                "slots_per_layer": {n: la.cache.num_slots for n, la in self.layers.items()},
                "resident_per_layer": {n: la.cache.num_resident()
                                       for n, la in self.layers.items()},
                "experts_per_layer": {n: la.cache.num_experts for n, la in self.layers.items()},
                "expert_bytes": {n: la.cache.experts.expert_nbytes
                                 for n, la in self.layers.items()},
                "store_bytes": self.store.nbytes,
                "pinned": self.store.pin_memory,
                "modeled": {
                    "bandwidth_gbps": link.bandwidth_gbps, "latency_us": link.latency_us,
                    "host_slowdown": link.host_slowdown,
                } if link.emulated else None,
                "link": {
                    "bytes": self.link.bytes_copied,
                    "copies": self.link.copies,
                    "stall_s": self.link.stall_s,
                },
                "total": total.to_dict(),
                "layers": {name: s.to_dict() for name, s in layers.items()},
            }

    def reset_stats(self) -> None:
        with self._lock:
            for layer in self.layers.values():
                layer.stats = LayerStats()
                layer.loader.stats = layer.stats.decode
        self.link.reset_counters()

    def write_stats(self) -> None:
        """Write the stats file now (``stats_path``; no-op without one)."""
        if self._stats_writer is not None:
            self._stats_writer.write()

    def close(self) -> None:
        if self._stats_writer is not None:
            self._stats_writer.close()
        if self._metrics_writer is not None:
            self._metrics_writer.close()
            with contextlib.suppress(OSError):  # a closed engine leaves /metrics
                os.remove(self._metrics_writer.path)
            self._metrics_writer = None
        self.link.close()
