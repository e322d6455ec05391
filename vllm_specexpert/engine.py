"""OffloadEngine: the per-worker orchestration of every offloaded MoE layer.

One engine per worker process holds the slow tier (:class:`ExpertStore`), the link (one
copy engine for all layers), per MoE layer an :class:`OffloadedLayer`, the miss policy,
the predictor and the planners. It has no vLLM dependency: the vLLM adapter in
``layers/`` hands it host tensors, a kernel per layer, each layer's successor with its
routing, and per forward pass which tokens are decode (:class:`PassPhases`).

It only orchestrates. A layer call's tokens are split by phase; prefill tokens run
exactly (the router's experts, loaded on demand). For decode tokens, per layer call:

1. the prediction made for this layer at the previous one, if any, is scored against the
   router's choice (and under ``speculate`` replaces it);
2. the predictor predicts the next layer's experts (read to the host with the router's
   ids, one read); their prefetch starts just before this layer's kernel
   (:class:`~vllm_specexpert.planner.prefetch.PrefetchPlanner`): the copy overlaps this
   layer's expert compute and the next layer's attention;
3. with a step's predicted demand (``path_predictor``, or the ``lookahead`` draft's
   routes), the PLEC planner plans the shared pool (:mod:`~vllm_specexpert.planner.plec`);
4. the executor surveys the cache, the miss policy decides about the missing entries
   (those a mesh peer holds go to it; predictions then fire rows at peers,
   :mod:`~vllm_specexpert.planner.early_fire`, instead of prefetching), the executor
   runs the plan (:mod:`vllm_specexpert.execute`), and under a ``quality`` budget its
   monitor samples the exact result beside it (:mod:`vllm_specexpert.quality`).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from vllm_specexpert import execute, report
from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.execute import ExpertKernel, LayerCall
from vllm_specexpert.handoff import StepDemand
from vllm_specexpert.layer_state import OffloadedLayer, check_change, check_runnable
from vllm_specexpert.log import init_logger
from vllm_specexpert.phases import PassPhases
from vllm_specexpert.planner.early_fire import EarlyFire
from vllm_specexpert.planner.governor import Governor
from vllm_specexpert.planner.lookahead import LookaheadPlanner
from vllm_specexpert.planner.plec import PlecPlanner
from vllm_specexpert.policy import MISS_POLICY_CLASSES, MissPolicy
from vllm_specexpert.predict import (
    PREDICTOR_CLASSES,
    LayerState,
    NextLayerRouting,
    Prediction,
    Predictor,
    PredictorInputs,
)
from vllm_specexpert.quality import LogitHead, QualityMonitor
from vllm_specexpert.tiers.host import HostKernel
from vllm_specexpert.tiers.layer_peers import LayerPeers
from vllm_specexpert.tiers.link import make_link
from vllm_specexpert.tiers.peer import PeerTier
from vllm_specexpert.tiers.slots import SharedSlotPool
from vllm_specexpert.tiers.staging import HostReader, upload
from vllm_specexpert.tiers.store import ExpertDecoder, ExpertStore

logger = init_logger(__name__)

LOW_BIT_SUFFIX = ".int4"
"""Store name of a layer's INT4 copies (``lowbit``)."""


class OffloadEngine:
    def __init__(self, config: SpecExpertConfig, device: torch.device, rank: int = 0,
                 reports: bool = True):
        self.config = config
        self.device = device
        self.rank = rank
        self.store = ExpertStore(pin_memory=device.type == "cuda")
        self.link = make_link(config.link, device)
        self.reader = HostReader(device)  # one read per decode call: ids + prediction
        # The running step's demand predicted by the scheduler's path predictor (set by
        # the vLLM adapter per layer call; ``None`` without one).
        self.step_demand: StepDemand | None = None
        self.layers: dict[str, OffloadedLayer] = {}
        self.predictor_inputs = PredictorInputs()  # the calibration's, estimator's
        self._predictions: dict[str, Prediction] = {}  # layer -> made earlier in the pass
        self.lock = threading.Lock()  # held while layers change or another thread reads
        self.reporter = report.Reporter(self.stats if reports else None)  # files, /metrics
        # ``lookahead``: the draft's routes as lookahead, its engine (set by
        # attach_draft), the draft length per step; a draft's engine: its target.
        self.lookahead: LookaheadPlanner | None = None
        self.draft_engine: OffloadEngine | None = None
        self.target: OffloadEngine | None = None
        self.governor: Governor | None = (Governor(config.lookahead.k_max, config.lookahead.k)
                                          if config.lookahead is not None else None)
        self.checkpoint: str | None = None  # the model's directory (mesh peers read it)
        self.mesh: PeerTier | None = None  # the mesh peers (attach_mesh)
        self.logit_head: LogitHead | None = None  # the model's (quality), set_logit_head
        self._select(config)

    def _select(self, config: SpecExpertConfig) -> None:
        """The miss policy, predictor, shared pool and its planner ``config`` names (a
        new pool: caches made from now on join it)."""
        self.miss_policy: MissPolicy = MISS_POLICY_CLASSES[config.miss_policy]()
        self._select_predictor(config)
        self.pool = SharedSlotPool(self.device) if config.cache_spec.shared_pool else None
        """The slot pool every layer shares (``plec``); ``None``: one per layer."""
        self.planner = (PlecPlanner(self.pool, config.plec_preload)
                        if self.pool is not None else None)
        mesh = config.mesh
        self.early_fire = EarlyFire(mesh.mode) if mesh and mesh.mode != "sync" else None
        self.quality = QualityMonitor.of(config.quality, self.logit_head, self.layers)

    def _select_predictor(self, config: SpecExpertConfig) -> None:
        predictor = PREDICTOR_CLASSES[config.predictor]
        self.predictor: Predictor | None = (
            None if predictor is None else predictor.build(self.predictor_inputs))

    # ------------------------------------------------------------------ setup

    def add_layer(
        self, name: str, tensors: dict[str, torch.Tensor], top_k: int, index: int = -1,
        host_kernel: HostKernel | None = None, decoder: ExpertDecoder | None = None,
        low_bit: tuple[dict[str, torch.Tensor], ExpertDecoder] | None = None,
    ) -> OffloadedLayer:
        """Move a layer's routed experts into the slow tier and give it a cache.
        ``host_kernel`` computes experts in slot form (``cpu``/``auto``); ``decoder``
        turns packed (quantized) experts into slot form; ``low_bit``: the packed INT4
        copies of a bf16 layer and their decoder (``lowbit``)."""
        self.store.add_layer(name, tensors, decoder)
        low_bit_experts = None
        if low_bit is not None:
            low_bit_experts = self.store.add_layer(name + LOW_BIT_SUFFIX, *low_bit)
        layer = OffloadedLayer(name=name, top_k=top_k, index=index,
                               experts=self.store.layers[name], host_kernel=host_kernel,
                               low_bit_experts=low_bit_experts)
        self.layers[name] = layer
        layer.equip(self.config, self.link, self.device, self.pool)
        return layer

    def attach_draft(self, draft: OffloadEngine) -> None:
        """``draft`` runs this engine's lookahead draft: its routes become this engine's
        lookahead (:class:`~vllm_specexpert.planner.lookahead.LookaheadPlanner`)."""
        self.draft_engine, draft.target = draft, self
        by_index = {layer.index: layer for layer in self.layers.values()}
        num_experts = next(iter(by_index.values())).cache.num_experts
        self.lookahead = LookaheadPlanner(num_experts, by_index.get)

    def attach_mesh(self, tier: PeerTier, local: dict[int, np.ndarray]) -> None:
        """Serve the layers' missing experts from ``tier``'s peers; ``local``: per layer
        index, experts pinned in the device cache instead (``replicate_hot``)."""
        self.mesh = tier
        for layer in self.layers.values():
            layer.peers = LayerPeers(tier, layer.index)
            layer.local_experts = local.get(layer.index)
            layer.equip(self.config, self.link, self.device, self.pool)

    def draft_routed(self, layer_index: int, ids: np.ndarray, weights: np.ndarray) -> None:
        """The draft's layer ``layer_index`` routed one pass (``[T, K]`` host arrays)."""
        with self.lock:
            self.lookahead.draft_routed(layer_index, ids, weights)

    def link_layers(self, name: str, next_name: str, routing: NextLayerRouting) -> None:
        """``next_name`` is the MoE layer after ``name`` and routes by ``routing``."""
        self.layers[name].next_name = next_name
        self.layers[name].next_routing = routing

    def set_predictor_inputs(self, inputs: PredictorInputs) -> None:
        """What the artifacts give the predictors (see :class:`PredictorInputs`)."""
        self.predictor_inputs = inputs.to(self.device)
        self._select_predictor(self.config)

    def set_logit_head(self, head: LogitHead) -> None:
        """The model's final norm and LM head (``quality`` compares logits with them)."""
        self.logit_head = head
        # Not a new selection: its new shared pool would not hold the layers' caches.
        self.quality = QualityMonitor.of(self.config.quality, head, self.layers)

    def set_routing_statistics(self, coactivation: dict[str, np.ndarray],
                               tae_percentiles: dict[str, np.ndarray]) -> None:
        """Per layer name: calibrated co-activation counts and TAE percentiles."""
        for name, layer in self.layers.items():
            layer.coactivation = np.asarray(coactivation[name])
            layer.tae_percentiles = np.asarray(tae_percentiles[name], dtype=np.float64)
            layer.set_miss_context(self.config, self.link)

    def start(self) -> None:
        """Every layer is loaded and wired: check that the configuration can run (fail
        at engine start, not mid-generation), allocate a shared slot pool, start the
        stats writers, and log one line that sums up the offload."""
        check_runnable(self.config, self.layers.values(), self.predictor_inputs)
        if self.pool is not None and not self.pool.tensors:
            self.pool.allocate()
        self.reporter.start(self.stats_file, self.config.stats_interval_s)
        logger.info("specexpert: %s", self.summary())

    def summary(self) -> str:  # MoE layers, slots, slow tier, policy, predictor
        return report.summary(self)

    @property
    def output(self) -> str:
        """What the running mode does to the model's output (``config.output``). On CUDA
        ``exact`` is reported ``equivalent``: unchecked on a GPU (``make gpu-check``)."""
        output = self.config.output
        return "equivalent" if output == "exact" and self.device.type != "cpu" else output

    def reconfigure(self, config: SpecExpertConfig) -> None:
        """Switch modes without reloading weights (checked first); caches rebuilt, counters
        restarted."""
        check_change(self.config, config, self.layers.values(), self.predictor_inputs)
        if config.quality is not None and self.logit_head is None:
            raise SpecExpertConfigError(
                "quality", "its monitor reads the model's final norm through a tap "
                "installed when an engine starts with a quality budget", "start the "
                "engine with 'quality' set (then it can change, or be turned off and on)")
        self._rebuild(config)
        logger.info("specexpert: reconfigured: %s", self.summary())

    def restart(self) -> None:
        """Back to the state of engine start (caches warm-started, nothing pending,
        counters at zero) once vLLM's warm-up passes are over: what they loaded would
        decide the first requests' hits (:func:`vllm_specexpert.plugins.restart_caches`)."""
        self._rebuild(self.config)
        if self.draft_engine is not None:
            self.draft_engine.restart()

    def _rebuild(self, config: SpecExpertConfig) -> None:
        """Every cache rebuilt for ``config`` (warm start), a new link, counters at zero."""
        with self.lock:
            for layer in self.layers.values():
                layer.loader.wait_all()  # nothing is freed while a copy into it runs
            self.link.close()
            self.config = config
            self.link = make_link(config.link, self.device)
            self._predictions.clear()
            for layer in self.layers.values():
                # Free the old pools before the new ones.
                layer.cache = layer.loader = layer.low_bit = None
            self._select(config)
            for layer in self.layers.values():
                layer.equip(config, self.link, self.device, self.pool)
            if self.pool is not None:
                self.pool.allocate()
            if self.governor is not None:
                self.governor = Governor(config.lookahead.k_max, config.lookahead.k)
            if self.lookahead is not None:
                self.lookahead.demand = None
            if self.mesh is not None:
                self.mesh.mesh = config.mesh
        self.reset_stats()
        self.reporter.start(self.stats_file, config.stats_interval_s)

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
        prediction to make: nothing to decide, so nothing is read to the host."""
        phase = layer.stats.prefill if phases is not None and phases.all_prefill \
            else layer.stats.decode
        call = LayerCall(x, topk_weights, topk_ids, None, kernel, phase.count_call(x.shape[0]))
        return execute.run_resident_token(layer.cache, call)

    def _run_prefill(self, layer: OffloadedLayer, kernel: ExpertKernel, x: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Prefill tokens: the router's experts, loaded on demand (exact). On CUDA the
        host read is the sync that on-demand loading cannot avoid: which experts to copy
        is only known once the router has run."""
        call = LayerCall(x, topk_weights, topk_ids, topk_ids.cpu().numpy(), kernel,
                         layer.stats.prefill.count_call(x.shape[0]))
        return execute.run(layer.loader, call, execute.survey(layer.loader, call))

    def _run_decode(self, layer: OffloadedLayer, kernel: ExpertKernel, x: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Decode tokens: prediction, prefetch, planning and the miss policy (module doc)."""
        stats = layer.stats.decode.count_call(x.shape[0])
        prediction = self._predictions.pop(layer.name, None)
        if prediction is not None and prediction.num_tokens != x.shape[0]:
            prediction = None
        run_weights, run_ids = topk_weights, topk_ids
        fired = (self.early_fire.at_call(layer.peers, layer.cache, x, prediction, stats)
                 if self.early_fire is not None else None)
        speculated = prediction is not None and (
            (self.miss_policy.spec.speculates and self._speculative(layer))
            or (fired is not None and self.early_fire.speculates))
        exact = self.quality is not None and self.quality.exact_for(x.shape[0])  # over budget
        if speculated:
            run_weights, run_ids = prediction.routing_like(topk_weights, topk_ids)
            stats.speculated_calls += not exact
            stats.router_free_calls += prediction.router_free
        # The next layer's prediction is made now, on the device, so that its ids come
        # to the host in the same read as the router's.
        upcoming = None
        if self.predictor is not None and layer.next_name is not None:
            state = LayerState(x, run_ids, run_weights)
            upcoming = self.predictor.predict(state, layer.name, layer.next_routing)
        router_ids, *predicted = self.reader.read(
            [topk_ids, *(upcoming.device_reads() if upcoming else ())])
        if upcoming is not None:
            upcoming.set_host(*predicted)
            if self.early_fire is not None:  # no_stop: the next layer's rows leave now
                self.early_fire.predicted(self.layers[layer.next_name], upcoming, lambda: (
                    self.predictor.next_router_input(state, layer.name, layer.next_routing)))
        if prediction is not None and not prediction.router_free:
            layer.prefetch.score(prediction, router_ids, stats)
        call = LayerCall(x, run_weights, run_ids,
                         prediction.host_ids if speculated else router_ids, kernel, stats,
                         fired=fired)
        if upcoming is not None:
            call.before_kernel = lambda: self._prefetch(layer, upcoming)
        demand = self.step_demand and self.step_demand.scored(layer.index, router_ids, stats)
        if demand is not None and self.planner is not None:
            self.planner.before_layer(demand, layer, list(self.layers.values()))
        layer.miss_context.copy_seconds = self.link.expert_seconds(layer.cache.experts)
        out = (execute.resolve(layer.loader, call, self.miss_policy, layer.miss_context)
               if self.quality is None else self.quality.resolve(
                   layer, call, topk_weights, router_ids, self.miss_policy))
        if demand is not None and self.planner is not None:
            self.planner.after_layer(demand, layer)
        return out

    def router_free_routing(self, name: str, tokens: int
                            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``router_free``: the routing a decode-only pass of ``tokens`` tokens at layer
        ``name`` runs without calling its router (the estimator's prediction, which
        ``speculate`` runs anyway), or ``None``: call the router."""
        prediction = self._predictions.get(name)
        if (not self.config.router_free or prediction is None or not prediction.by_estimator
                or (self.quality is not None and self.quality.exact_for(tokens))
                or prediction.num_tokens != tokens or not self.miss_policy.spec.speculates
                or not self._speculative(self.layers[name])):
            return None
        prediction.router_free = True
        return prediction.topk_weights, prediction.topk_ids

    def _speculative(self, layer: OffloadedLayer) -> bool:
        exact_layers = self.config.exact_layers
        if exact_layers is None:
            return True  # the first MoE layer never has a prediction
        return layer.index not in exact_layers

    def _prefetch(self, layer: OffloadedLayer, prediction: Prediction) -> None:
        """Record ``prediction`` for the next layer and submit its prefetch."""
        self._predictions[layer.next_name] = prediction
        nxt = self.layers[layer.next_name]
        if self.mesh is not None:
            return  # under a mesh, predictions fire rows at peers (EarlyFire), not copies
        everything = self.config.prefetch_filter == "all" or (
            self.miss_policy.spec.speculates and self._speculative(nxt))
        nxt.prefetch.prefetch(prediction, nxt.loader, nxt.stats.decode,
                              self.link.expert_seconds(nxt.cache.experts), everything)

    # ---------------------------------------------------------------- statistics

    @property
    def stats_file(self) -> str | None:
        path = self.config.stats_path
        return path.replace("{rank}", str(self.rank)) if path else None

    def stats(self) -> dict:
        """Per-layer counters by phase, their totals, link counters and the
        configuration (:func:`vllm_specexpert.report.engine_stats`)."""
        return report.engine_stats(self)

    def reset_stats(self) -> None:
        report.reset_counters(self)  # every layer's, the link's, governor's, peers', draft's

    def write_stats(self) -> None:
        self.reporter.write_now()  # the stats file and the metrics snapshot, if any

    def close(self) -> None:
        self.reporter.close()
        self.link.close()
        if self.mesh is not None:
            self.mesh.close()
