"""OffloadEngine: the exact spine of every offloaded MoE layer's call, in one worker.

One engine per worker process holds the slow tier (:class:`ExpertStore`), the link (one
copy engine for all layers), per MoE layer an :class:`OffloadedLayer`, the miss policy
and the features the config turns on. It has no vLLM dependency: the vLLM adapter in
``layers/`` hands it host tensors, a kernel per layer, each layer's successor with its
routing, and per forward pass which tokens are decode (:class:`PassPhases`).

Prefill tokens run exactly (the router's experts, loaded on demand). A decode call is
the spine: one host read of the router's ids, a survey of the cache, the miss policy's
plan for what is missing, the executor (:mod:`vllm_specexpert.execute`). Everything
else is a feature whose hooks the engine calls around it in order, built by one factory
from the config and the inputs the adapter provides (:mod:`vllm_specexpert.features`).

Experts the slow tier cannot supply mid-generation (:class:`ExpertsUnreadable`: a read
error, a record whose checksum fails) do not stop the pass: the executor runs the call
again without them (:func:`~vllm_specexpert.execute.run_without`), and the rows that
needed them are kept (:attr:`unreadable`) for the adapter, which fails their requests.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
import torch

from vllm_specexpert import execute, features, report
from vllm_specexpert.budget_plan import BudgetPlan, SlotPlan
from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.features import DecodeCall, EngineFeature, FeatureInputs
from vllm_specexpert.handback import UnreadableRows
from vllm_specexpert.handoff import StepDemand
from vllm_specexpert.layer_call import ExpertKernel, LayerCall
from vllm_specexpert.layer_state import OffloadedLayer, check_pool_reach
from vllm_specexpert.log import init_logger
from vllm_specexpert.phases import PassPhases
from vllm_specexpert.policy import MISS_POLICY_CLASSES, MissPolicy
from vllm_specexpert.predict import NextLayerRouting
from vllm_specexpert.stats import PhaseStats
from vllm_specexpert.stats_writers import Reporter
from vllm_specexpert.tiers.host import HostKernel
from vllm_specexpert.tiers.link import make_link
from vllm_specexpert.tiers.slots import SharedSlotPool
from vllm_specexpert.tiers.staging import HostReader, upload
from vllm_specexpert.tiers.store import (
    ExpertDecoder,
    ExpertSource,
    ExpertStore,
    ExpertsUnreadable,
)

logger = init_logger(__name__)


class OffloadEngine:
    def __init__(
        self,
        config: SpecExpertConfig,
        device: torch.device,
        rank: int = 0,
        reports: bool = True,
        budget_field: str = "budget",
    ):
        self.config = config
        """The user's config, as given (what its budget came to: :attr:`budget`)."""
        self.device = device
        self.rank = rank
        self.store = ExpertStore(pin_memory=device.type == "cuda")
        self.link = make_link(config.link, device)
        self.reader = HostReader(device)  # one read per decode call: ids + prediction
        # The running step's demand predicted by the scheduler's path predictor (set by
        # the vLLM adapter per layer call; ``None`` without one).
        self.step_demand: StepDemand | None = None
        self.layers: dict[str, OffloadedLayer] = {}
        self.lock = threading.Lock()  # held while layers change or another thread reads
        self.reporter = Reporter(self.stats if reports else None)  # files, /metrics
        self.inputs = FeatureInputs()
        """What the vLLM adapter hands in (:meth:`provide`), which features are built from."""
        self.budget = BudgetPlan(device, budget_field)
        """What the budget comes to in slots per layer, and why (its ``sizing``: what it
        needs of vLLM's settings, filled by the adapter)."""
        self.unreadable = UnreadableRows()
        """Rows of the running pass that needed an expert the slow tier could not supply
        (the adapter fails their requests)."""
        self._select(config)
        self._build_features(config)

    def _select(self, config: SpecExpertConfig) -> None:
        """The miss policy and shared pool ``config`` names (a new pool: caches made from
        now on join it)."""
        self._policy: MissPolicy = MISS_POLICY_CLASSES[config.miss_policy]()
        self.pool = SharedSlotPool(self.device) if config.cache_spec.shared_pool else None
        """The slot pool every layer shares (``plec``); ``None``: one per layer."""

    def _build_features(self, config: SpecExpertConfig) -> None:
        """The features ``config`` turns on, each equipping the layers there are."""
        self.miss_policy = self._policy  # (what the features are built with)
        self.features: list[EngineFeature] = features.build(config, self)
        """In the order their hooks are called (:mod:`vllm_specexpert.features`)."""
        for feature in self.features:
            self.miss_policy = feature.miss_policy(self.miss_policy)
            for layer in self.layers.values():
                if layer.equipped:
                    feature.equip(layer)
        self._sees_resident_calls = any(f.acts_on_resident_calls for f in self.features)

    def provide(self, **inputs: Any) -> None:
        """Inputs of the features, as the adapter gets them (:class:`FeatureInputs`'
        fields by name): the features are built again with them."""
        self.inputs = dataclasses.replace(self.inputs, **inputs)
        self._build_features(self.config)

    def feature(self, name: str) -> EngineFeature | None:
        """The running feature called ``name``, if it is on."""
        return next((f for f in self.features if f.name == name), None)

    # ------------------------------------------------------------------ setup

    def add_layer(
        self,
        name: str,
        experts: dict[str, torch.Tensor] | ExpertSource,
        top_k: int,
        index: int = -1,
        host_kernel: HostKernel | None = None,
        decoder: ExpertDecoder | None = None,
        pool_reach: int | None = None,
    ) -> OffloadedLayer:
        """Move a layer's routed experts into the slow tier and give it a cache.
        ``experts``: its tensors (``[E, ...]`` each, moved into host memory) or the
        ``ExpertSource`` that already holds them. ``host_kernel`` computes experts in
        slot form (``cpu``/``auto``); ``decoder`` turns packed (quantized) tensors into slot form.
        What the store already holds beside them (:meth:`OffloadedLayer.of`) comes with
        the layer."""
        if isinstance(experts, dict):
            self.store.add_layer(name, experts, decoder)
        else:
            self.store.add(experts)
        layer = OffloadedLayer.of(self.store, name, top_k, index, host_kernel, pool_reach)
        if self.budget.current is None:
            # The weights are loaded and no slot is made yet: the memory sizing reads.
            self.budget.adopt(self.budget.plan(self.config, layer.experts, top_k))
        self.layers[name] = layer
        layer.equip(self.config, self._slots(layer), self.link, self.device, self.pool)
        for feature in self.features:
            feature.equip(layer)
        return layer

    def link_layers(self, name: str, next_name: str, routing: NextLayerRouting) -> None:
        """``next_name`` is the MoE layer after ``name`` and routes by ``routing``."""
        self.layers[name].next_name = next_name
        self.layers[name].next_routing = routing

    def set_routing_statistics(
        self, coactivation: dict[str, np.ndarray], tae_percentiles: dict[str, np.ndarray]
    ) -> None:
        """Per layer name: calibrated co-activation counts and TAE percentiles."""
        for name, layer in self.layers.items():
            layer.coactivation = np.asarray(coactivation[name])
            layer.tae_percentiles = np.asarray(tae_percentiles[name], dtype=np.float64)
            layer.set_miss_context(self.config, self.link)

    def start(self) -> None:
        """Every layer is loaded and wired: check that the configuration can run (fail
        at engine start, not mid-generation), allocate a shared slot pool, start the
        stats writers, and log one line that sums up the offload."""
        features.check_start(self.config, self.layers.values(), self.inputs)
        self._check_pool_reach(self.config, self.budget.current)
        if self.pool is not None and not self.pool.tensors:
            self.pool.allocate()
        self.reporter.start(self.stats_file, self.config.stats_interval_s)
        logger.info("specexpert: %s", self.summary())

    def _slots(self, layer: OffloadedLayer, plan: SlotPlan | None = None) -> int:
        plan = plan or self.budget.current
        assert plan is not None  # (planned at the first layer)
        return plan.slots(layer.experts.num_experts, layer.top_k)

    def _check_pool_reach(self, config: SpecExpertConfig, plan: SlotPlan | None) -> None:
        if self.layers:
            check_pool_reach(config, [(la, self._slots(la, plan)) for la in self.layers.values()])

    def summary(self) -> str:  # MoE layers, slots, slow tier, policy, predictor
        return report.summary(self)

    @property
    def output(self) -> str:
        """What the running mode does to the model's output (``config.output``). On CUDA
        ``exact`` is reported ``equivalent``: unchecked on a GPU (``make gpu-check``)."""
        output = self.config.output
        return "equivalent" if output == "exact" and self.device.type != "cpu" else output

    def _slot_bytes(self) -> int:
        """Bytes of every layer's slots (their pools', freed by a rebuild)."""
        return sum(
            la.cache.num_slots * la.experts.slot_nbytes
            for la in self.layers.values()
            if la.equipped
        )

    def reconfigure(self, config: SpecExpertConfig) -> None:
        """Switch modes without reloading weights (checked first); caches rebuilt, counters
        restarted."""
        first = next(iter(self.layers.values()), None)
        plan = self.budget.current
        if first is not None:
            plan = self.budget.plan(config, first.experts, first.top_k, self._slot_bytes())
        features.check_reconfigure(self.config, config, self.layers.values(), self.inputs)
        self._check_pool_reach(config, plan)
        if plan is not None:
            self.budget.adopt(plan)
        self._rebuild(config)
        logger.info("specexpert: reconfigured: %s", self.summary())

    def restart(self) -> None:
        """Back to the state of engine start (caches warm-started, nothing pending,
        counters at zero) once vLLM's warm-up passes are over: what they loaded would
        decide the first requests' hits (:func:`vllm_specexpert.plugins.restart_caches`)."""
        self._rebuild(self.config)
        for feature in self.features:
            feature.restart()

    def _rebuild(self, config: SpecExpertConfig) -> None:
        """Every cache rebuilt for ``config`` (warm start), a new link, counters at zero."""
        with self.lock:
            for layer in self.layers.values():
                layer.loader.wait_all()  # nothing is freed while a copy into it runs
            self.link.close()
            self.config = config
            self.link = make_link(config.link, self.device)
            for layer in self.layers.values():
                # Free the old pools before the new ones.
                layer.unequip()
            if self.pool is not None:
                self.pool.release()
            self._select(config)
            for layer in self.layers.values():
                layer.equip(config, self._slots(layer), self.link, self.device, self.pool)
            self._build_features(config)
            if self.pool is not None:
                self.pool.allocate()
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
        try:
            return self._run(name, kernel, x, topk_weights, topk_ids, phases)
        except ExpertsUnreadable as error:  # (module doc)
            call = LayerCall(
                x, topk_weights, topk_ids, topk_ids.cpu().numpy(), kernel, PhaseStats()
            )
            return execute.run_without(self.layers[name].loader, call, error, self.unreadable)

    def _run(
        self,
        name: str,
        kernel: ExpertKernel,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        phases: PassPhases | None,
    ) -> torch.Tensor:
        if x.shape[0] == 1:
            prefill = phases is not None and phases.all_prefill
            out = self.run_resident_token(name, kernel, x, topk_weights, topk_ids, prefill)
            if out is not None:
                return out
        layer = self.layers[name]
        if phases is None or phases.all_decode:
            return self._run_decode(layer, kernel, x, topk_weights, topk_ids)
        if phases.all_prefill:
            return self._run_prefill(layer, kernel, x, topk_weights, topk_ids)
        # A mixed pass (chunked prefill beside decoding requests): decode rows first, so
        # that their prefetched experts are released by their own call.
        out = torch.empty_like(x)
        for rows, run in ((phases.decode, self._run_decode), (phases.prefill, self._run_prefill)):
            index = upload(rows, x.device)
            out[index] = run(layer, kernel, x[index], topk_weights[index], topk_ids[index])
        return out

    def run_resident_token(
        self,
        name: str,
        kernel: ExpertKernel,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        prefill: bool = False,
    ) -> torch.Tensor | None:
        """One token on layer ``name`` when its every expert is resident (budget 1.0)
        and no feature acts on such a call: nothing to decide, so nothing is read to the
        host. ``None`` when the call needs the full path (:meth:`run`). The layer's
        entry tries this first, without the pass's phases: at batch-1 decode this path's
        cost is the plugin's whole cost over vanilla. Counted as decode unless
        ``prefill`` (by vLLM's own split a one-token pass decodes; the passes without
        attention metadata, profile and warm-up runs, end before the counters restart)."""
        layer = self.layers[name]
        if self._sees_resident_calls or not layer.cache.identity:
            return None
        phase = layer.stats.prefill if prefill else layer.stats.decode
        return execute.run_resident_token(
            layer.cache, kernel, x, topk_weights, topk_ids, phase.count_call(1)
        )

    def _run_prefill(
        self,
        layer: OffloadedLayer,
        kernel: ExpertKernel,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Prefill tokens: the router's experts, loaded on demand (exact). On CUDA the
        host read is the sync that on-demand loading cannot avoid: which experts to copy
        is only known once the router has run."""
        call = LayerCall(
            x,
            topk_weights,
            topk_ids,
            topk_ids.cpu().numpy(),
            kernel,
            layer.stats.prefill.count_call(x.shape[0]),
        )
        return execute.run(layer.loader, call, execute.survey(layer.loader, call))

    def _run_decode(
        self,
        layer: OffloadedLayer,
        kernel: ExpertKernel,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Decode tokens: the features' hooks around one host read, the miss policy and
        the executor (:mod:`vllm_specexpert.features`)."""
        call = DecodeCall(
            layer,
            x,
            topk_weights,
            topk_ids,
            kernel,
            layer.stats.decode.count_call(x.shape[0]),
            topk_weights,
            topk_ids,
        )
        call.exact = any(f.forces_exact(call.num_tokens) for f in self.features)
        for feature in self.features:
            feature.begin_call(call)
        for feature in self.features:
            feature.before_read(call)
        router_ids, *host = self.reader.read([topk_ids, *call.device_reads()])
        call.router_host_ids = router_ids
        call.deliver(host)
        for feature in self.features:
            feature.after_read(call)
        try:
            return self._resolve(0, call, call.layer_call())
        finally:  # (also when an expert could not be read: the call runs again without)
            for feature in self.features:
                feature.end_call(call)

    def _resolve(self, at: int, call: DecodeCall, run: LayerCall) -> torch.Tensor:
        """Feature ``at``'s ``resolve`` around the later ones'; after the last, the miss
        policy's plan, run by the executor."""
        if at == len(self.features):
            context = call.layer.miss_context
            assert context is not None  # (the start refused a layer without one)
            return execute.resolve(call.layer.loader, run, self.miss_policy, context)
        return self.features[at].resolve(call, run, lambda c, r: self._resolve(at + 1, c, r))

    def router_free_routing(
        self, name: str, tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``router_free``: the routing a decode-only pass of ``tokens`` tokens at layer
        ``name`` runs without calling its router, or ``None``: call the router."""
        if any(f.forces_exact(tokens) for f in self.features):
            return None
        layer = self.layers[name]
        return next(
            (
                routing
                for f in self.features
                if (routing := f.routing_for(layer, tokens)) is not None
            ),
            None,
        )

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
        report.reset_counters(self)  # every layer's, the link's, the features'

    def write_stats(self) -> None:
        self.reporter.write_now()  # the stats file and the metrics snapshot, if any

    def close(self) -> None:
        self.reporter.close()
        self.link.close()
        self.store.close()
        for feature in self.features:
            feature.close()
