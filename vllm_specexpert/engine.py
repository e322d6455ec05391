"""OffloadEngine: the exact spine of every offloaded MoE layer's call, in one worker.

One engine per worker process holds the slow tier (:class:`ExpertStore`), the link (one
copy engine for all layers), per MoE layer an :class:`OffloadedLayer`, the miss policy
and the features the config turns on. It has no vLLM dependency: the adapter in
``layers/`` hands it the layers, their successors, the features' inputs
(:meth:`provide`) and each call (:class:`LayerCall`).

Each layer's call is a pipeline (:mod:`vllm_specexpert.pipeline`) composed when the
layer is equipped and whenever the features change: prefill tokens run exactly (the
router's experts, loaded on demand); a decode call is one host read of the router's ids,
the miss policy's plan for what is missing and the executor
(:mod:`vllm_specexpert.execute`), with the stages the features add
(:mod:`vllm_specexpert.features`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Iterator
from typing import Any, TypeVar

import torch

from vllm_specexpert import features, pipeline, report
from vllm_specexpert.budget_plan import BudgetPlan, SlotPlan, check_pool_reach
from vllm_specexpert.config import SpecExpertConfig, check_switch
from vllm_specexpert.config.sizing import region_split
from vllm_specexpert.features import EngineFeature, EngineParts
from vllm_specexpert.handback import UnreadableRows
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.layer_checks import check_layers
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.log import init_logger
from vllm_specexpert.policy import MissPolicy
from vllm_specexpert.read_ahead import LaunchProbe, RegionReadAhead, probe_launch, reserved_rows
from vllm_specexpert.stats_writers import Reporter
from vllm_specexpert.tiers.host import HostKernel
from vllm_specexpert.tiers.link import make_link
from vllm_specexpert.tiers.shared_region import RegionRefused, SharedRegion
from vllm_specexpert.tiers.slots import LayerSlotPool, RegionRows, SharedPools, SlotPool
from vllm_specexpert.tiers.staging import HostReader
from vllm_specexpert.tiers.store import ExpertDecoder, ExpertSource, ExpertStore

logger = init_logger(__name__)

F = TypeVar("F", bound=EngineFeature)


class OffloadEngine:
    def __init__(
        self,
        config: SpecExpertConfig,
        device: torch.device,
        rank: int = 0,
        reports: bool = True,
        budget_field: str = "budget",
        splits_slots: bool = True,
        slots_deferred: bool = False,
    ):
        self.config = config
        """The user's config, as given (what its budget came to: :attr:`budget`)."""
        self.device = device
        self.rank = rank
        self.store = ExpertStore(pin_memory=device.type == "cuda")
        self.link = make_link(config.link, device)
        self.reader = HostReader(device)  # one read per decode call: ids + features'
        self.layers: dict[str, OffloadedLayer] = {}
        self.lock = threading.Lock()  # held while layers change or another thread reads
        self.reporter = Reporter(self.stats if reports else None, self.series)  # files, /metrics
        self.inputs: dict[str, Any] = {}
        """What the adapter handed in for the features, by the names they declare."""
        self.budget = BudgetPlan(device, budget_field)
        """What the budget comes to in slots per layer (its ``sizing``: vLLM's settings,
        filled by the adapter)."""
        self.unreadable = UnreadableRows()
        """Rows of the running pass whose experts the slow tier could not supply."""
        self.features: list[EngineFeature] = []
        self.pipelines: dict[str, pipeline.LayerPipeline] = {}
        """Each equipped layer's call, as composed (``describe`` lists its stages)."""
        self._skipping = False
        """Calls run no routed expert (:meth:`experts_skipped`)."""
        self.splits_slots = splits_slots
        """Whether a layer's slots may be split into its own and a shared region's
        (:meth:`_region_for`); not where another engine sizes them."""
        self.slots_deferred = slots_deferred
        """Layers are added without slots (their calls run no routed expert, output zero)
        until :meth:`equip_deferred`: an engine whose output only guides another's and
        whose memory that one holds meanwhile."""
        self.regions: dict[tuple, RegionRows] = {}
        """The shared regions of the layers' own pools and who holds their rows, by their
        rows and slot shapes (:meth:`_region_for`); ``region_refused``: why none could be
        made."""
        self.region_refused: str | None = None
        self.launch_probe: LaunchProbe | None = None
        """A launch of ``max_num_seqs`` tokens and reads beside it, probed at the first
        region (``config.read_ahead_rows`` ``"auto"``)."""
        self._select(config)
        self._build_features()

    def _select(self, config: SpecExpertConfig) -> None:
        self.miss_policy_class: type[MissPolicy] = features.miss_policy_classes()[
            config.miss_policy
        ]
        """The config's miss policy; each layer's is built when its call is composed."""
        self.pools = SharedPools(self.device) if config.cache_spec.shared_pool else None
        """The slot pools layers share (a shared-pool cache); ``None``: one per layer."""

    def _parts(self, config: SpecExpertConfig) -> EngineParts:
        return EngineParts(
            config, self.layers, self.store, self.link, self.lock, self.output,
        )  # fmt: skip

    def _build_features(self, given: set[str] | None = None) -> None:
        """The features the config turns on (with ``given`` inputs: those that take one
        of them built again), each equipping the layers there are."""
        built = features.build(self._parts(self.config), self.inputs, self.features, given)
        for layer in self._equipped():
            for old in self.features:
                if old not in built:
                    old.unequip(layer)
            for feature in built:
                if feature not in self.features:
                    feature.equip(layer)
        self.features = built
        for layer in self._equipped():
            self._compose(layer)

    def provide(self, **inputs: Any) -> None:
        """Inputs of the features, as the adapter gets them, by the names the features
        declare (:attr:`EngineFeature.inputs`); the features that take them are built
        again."""
        features.check_inputs(set(inputs))
        self.inputs.update(inputs)
        self._build_features(set(inputs))

    def feature(self, kind: type[F]) -> F | None:
        """The running feature of class ``kind``, if it is on."""
        return next((f for f in self.features if isinstance(f, kind)), None)

    def _equipped(self) -> list[OffloadedLayer]:
        return [layer for layer in self.layers.values() if layer.equipped]

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
        """Move a layer's routed experts into the slow tier (``experts``: its ``[E, ...]``
        tensors, or the source that holds them) and give it a cache. ``host_kernel``
        computes experts in slot form; ``decoder`` turns packed tensors into slot form."""
        if isinstance(experts, dict):
            self.store.add_layer(name, experts, decoder)
        else:
            self.store.add(experts)
        layer = OffloadedLayer(name, top_k, index, self.store.layers[name], host_kernel, pool_reach)
        if self.budget.current is None:
            # The weights are loaded and no slot is made yet: planned from the memory now.
            self.budget.adopt(self.budget.plan(self.config, layer.experts, top_k))
        self.layers[name] = layer
        if not self.slots_deferred:
            self._equip(layer)
        return layer

    def equip_deferred(self) -> None:
        """Give the layers added under :attr:`slots_deferred` their slots (warm-started)."""
        with self.lock:
            self.slots_deferred = False
            layers = [layer for layer in self.layers.values() if not layer.equipped]
            for layer in layers:
                self._equip(layer)
            if self.pools is not None:
                self.pools.allocate()
        self._log_unreadable(layers)

    def _equip(self, layer: OffloadedLayer) -> None:
        plan = self.budget.current
        assert plan is not None  # (planned at the first layer)
        slots = plan.slots(layer.experts.num_experts, layer.top_k)
        slots -= sum(f.reserved_slots(layer, slots) for f in self.features)
        pool: SlotPool | None = None
        if self.pools is not None:
            pool = self.pools.pool_for(layer.experts, slots, layer.pool_reach)
        else:
            slots, region = self._region_for(layer, slots)
            pool = LayerSlotPool(self.device, region) if region is not None else None
        layer.equip(self.config, slots, self.link, self.device, pool)
        for feature in self.features:
            feature.equip(layer)
        self._compose(layer)

    def _compose(self, layer: OffloadedLayer) -> None:
        """The layer's call, composed from its cache and the features that are on (when
        it is equipped and whenever the features change); a layer that stops holding
        every expert in the slot of its id is composed again."""
        layer.cache.identity_lost = functools.partial(self._compose, layer)
        parts = [part for f in self.features for part in f.stages(layer)]
        if layer.cache.pool.rows is not None:
            parts.append(RegionReadAhead(layer, functools.partial(self._following, layer)).stage())
        policy = self.miss_policy_class.of_layer(layer.places)
        for feature in self.features:
            policy = feature.miss_policy(policy, layer)
        composed = pipeline.compose(layer, policy, parts, self.reader, self.unreadable)
        self.pipelines[layer.name] = composed

    def _following(self, layer: OffloadedLayer) -> OffloadedLayer | None:
        """The layer whose call comes after ``layer``'s in the pass, on the same shared
        region, if any (the last layer has none: a read ahead of the next pass's first
        layer would still be moving when the pass ends, and wasted after the last)."""
        nxt = self.layers.get(layer.next_name) if layer.next_name is not None else None
        if nxt is None or not nxt.equipped:
            return None
        rows = nxt.cache.pool.rows
        return nxt if rows is not None and rows is layer.cache.pool.rows else None

    def _region_for(self, layer: OffloadedLayer, slots: int) -> tuple[int, RegionRows | None]:
        """The layer's own slots and the shared region its pool covers after them: where
        its experts are read from a slow tier whose bytes bind (each read once), the policy
        loads every missing expert on the device (``fetch``, ``stream``) into a layer's
        own pool on the CPU build, and the batch may need more experts than ``slots``
        (``max_num_seqs * top_k``), the budget's slots of every layer split
        (:func:`~vllm_specexpert.config.sizing.region_split`); else ``slots`` and none."""
        sizing, experts = self.budget.sizing, layer.experts
        if (
            not self.splits_slots
            or self.device.type != "cpu"
            or experts.memory_nbytes >= experts.nbytes
            or not self.config.loads_through_region
            or experts.in_place
            or sizing.max_num_seqs == 0
        ):
            return slots, None
        ahead = reserved_rows(
            self.config.read_ahead_rows,
            sizing.max_num_seqs,
            layer.top_k,
            experts.num_experts,
            functools.partial(self._launch_reads, layer),
        )
        split = region_split(
            slots,
            sizing.moe_layers,
            experts.num_experts,
            layer.top_k,
            sizing.max_num_seqs * layer.top_k,
            ahead,
        )
        widest = max(math.prod(shape) for shape, _ in experts.slot_shapes.values())
        reach = layer.pool_reach
        if not split.rows or (reach is not None and (split.own + split.rows) * widest > reach):
            return slots, None
        key = (
            split.rows,
            tuple(sorted((n, s, str(d)) for n, (s, d) in experts.slot_shapes.items())),
        )
        region = self.regions.get(key)
        if region is None:
            try:
                region = self.regions[key] = RegionRows(
                    SharedRegion(split.rows, experts.slot_shapes)
                )
            except RegionRefused as refused:
                self.region_refused = str(refused)
                return slots, None
        return split.own, region

    def _launch_reads(self, layer: OffloadedLayer) -> float | None:
        """The reads worth keeping rows for (:meth:`LaunchProbe.rows`), probed once (the
        first region made) and kept for every layer and rebuild."""
        sizing = self.budget.sizing
        if self.launch_probe is None:
            self.launch_probe = probe_launch(layer, sizing.max_num_seqs, sizing.hidden_size)
        if self.launch_probe is None:
            return None
        return self.launch_probe.rows(layer.experts.num_experts, sizing.moe_layers)

    def slot_bytes_held(self) -> int:
        """The memory of the layers' slots, each layer's own and each shared region's rows
        once: what a rebuild frees before it makes the new ones."""
        equipped = self._equipped()
        own = sum(la.cache.num_slots * la.experts.slot_nbytes for la in equipped)
        regions = {id(la.cache.pool.region): la for la in equipped if la.cache.pool.region_rows}
        return own + sum(
            la.cache.pool.region_rows * la.experts.slot_nbytes for la in regions.values()
        )

    def _close_regions(self) -> None:
        for rows in self.regions.values():
            rows.region.close()  # (the memory goes with the last pool's tensors on it)
        self.regions = {}

    def link_layers(self, name: str, next_name: str) -> None:
        """``next_name`` is the MoE layer after ``name``."""
        self.layers[name].next_name = next_name

    def _check(self, config: SpecExpertConfig, plan: SlotPlan | None) -> None:
        """Raise a config error if ``config`` cannot run on the loaded layers with the
        inputs given (at start, and before a reconfigure: never mid-generation)."""
        check_layers(config, self.layers.values())
        features.check(self._parts(config), self.inputs)
        if plan is not None:
            check_pool_reach(plan, self.layers.values())

    def start(self) -> None:
        """Every layer is loaded and wired: check that the config can run, allocate a
        shared pool, start the stats writers, and log one line that sums it up."""
        self._check(self.config, self.budget.current)
        if self.pools is not None:
            self.pools.allocate()
        self._log_unreadable(self._equipped())
        self.reporter.start(self.stats_file, self.config.stats_interval_s)
        logger.info("specexpert: %s", self.summary())
        self._warn_unbudgeted()

    def _warn_unbudgeted(self) -> None:
        if (warning := self.config.unbudgeted) is not None:
            logger.warning("specexpert: %s", warning)

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
        restarted. A rebuild that fails (an expert its warm start cannot read, among
        others) puts back what ran before: the same config and features, the caches
        warm-started again, the counters kept; then raises."""
        first = next(iter(self.layers.values()), None)
        plan = self.budget.current
        if first is not None:
            plan = self.budget.plan(config, first.experts, first.top_k, self.slot_bytes_held())
        check_switch(self.config, config)
        self._check(config, plan)
        before, before_plan, layers = self.config, self.budget.current, self._equipped()
        try:
            if plan is not None:
                self.budget.adopt(plan)
            self._rebuild(config, layers)
            unreadable = next((la.cache.unreadable for la in layers if la.cache.unreadable), None)
            if unreadable is not None:
                raise unreadable.refusal("the engine runs on as it was")
        except BaseException:
            if before_plan is not None:
                self.budget.adopt(before_plan)
            self._rebuild(before, layers)
            self._log_unreadable(layers)
            raise
        self._restarted()
        logger.info("specexpert: reconfigured: %s", self.summary())
        self._warn_unbudgeted()

    def adopt(self, plan: SlotPlan) -> None:
        """The layers' caches rebuilt on ``plan`` (warm-started), the config, features
        and counters as they are: the slots a plan lent given back."""
        self.budget.adopt(plan)
        layers = self._equipped()
        self._rebuild(self.config, layers, same_config=True)
        self._log_unreadable(layers)

    def restart(self) -> None:
        """Back to the state of engine start (caches warm-started, nothing pending,
        counters at zero) once vLLM's warm-up passes are over: what they loaded would
        decide the first requests' hits (:func:`vllm_specexpert.plugins.restart_caches`)."""
        layers = self._equipped()
        self._rebuild(self.config, layers)
        self._log_unreadable(layers)
        self._restarted()
        for feature in self.features:
            feature.restart()

    def _rebuild(
        self, config: SpecExpertConfig, layers: list[OffloadedLayer], same_config: bool = False
    ) -> None:
        """``layers``' caches rebuilt for ``config`` (warm start) with a new link and
        features; ``same_config``: the running link and features kept."""
        with self.lock:
            equipped = self._equipped()
            for layer in equipped:
                layer.loader.wait_all()  # nothing is freed while a copy into it runs
            if not same_config:
                self.link.close()
            for layer in equipped:  # the old pools are freed before the new ones
                for feature in self.features:
                    feature.unequip(layer)
                layer.unequip()
            if self.pools is not None:
                self.pools.release()
            self._close_regions()
            self._select(config)
            if not same_config:
                self.config = config
                self.link = make_link(config.link, self.device)
                self._build_features()
            for layer in layers:
                self._equip(layer)
            if self.pools is not None:
                self.pools.allocate()

    def _restarted(self) -> None:
        """Counters at zero and the stats writers on the config's schedule."""
        self.reset_stats()
        self.reporter.start(self.stats_file, self.config.stats_interval_s)

    def _log_unreadable(self, layers: list[OffloadedLayer]) -> None:
        """What the caches' warm start could not read, logged once per expert: those
        experts are read when a request needs them, failing only that request if the
        read fails again."""
        for layer in layers:
            error = layer.cache.unreadable
            if error is not None:
                self.unreadable.log(error.layer, error.causes, "at the warm start: ")

    # ---------------------------------------------------------------- forward

    def run_call(self, request: LayerCall) -> torch.Tensor:
        """Routed-expert output of one layer call, through the layer's pipeline
        (:meth:`_compose`); zero inside :meth:`experts_skipped` and while the slots are
        deferred."""
        if self._skipping or self.slots_deferred:
            return torch.zeros_like(request.x)
        composed = self.pipelines[request.layer]
        return composed.run(request)

    @contextlib.contextmanager
    def experts_skipped(self) -> Iterator[None]:
        """Calls inside run no routed expert: their output is zero, nothing is read or
        computed. For an engine whose output only guides another's, in a pass run only to
        keep its KV cache."""
        self._skipping = True
        try:
            yield
        finally:
            self._skipping = False

    # ---------------------------------------------------------------- statistics

    @property
    def stats_file(self) -> str | None:
        path = self.config.stats_path
        return path.replace("{rank}", str(self.rank)) if path else None

    def stats(self) -> dict:
        """Per-layer counters by phase, their totals, the link's, the features' sections
        and the configuration (:func:`vllm_specexpert.report.engine_stats`)."""
        return report.engine_stats(self)

    def series(self) -> list[dict]:
        """The features' ``/metrics`` series (:func:`vllm_specexpert.report.feature_series`)."""
        return report.feature_series(self)

    def reset_stats(self) -> None:
        report.reset_counters(self)  # every layer's, the link's, the features'

    def write_stats(self) -> None:
        self.reporter.write_now()  # the stats file and the metrics snapshot, if any

    def close(self) -> None:
        self.reporter.close()
        self.link.close()
        self.store.close()
        self._close_regions()
        for feature in self.features:
            feature.close()
