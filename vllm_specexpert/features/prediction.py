"""Next-layer prediction as an engine feature: at each decode call of layer l the
predictor predicts layer l+1's experts (their ids come to the host in the call's one
read); the prefetch of what is predicted starts just before layer l's kernel, so the copy
overlaps its expert compute (:class:`~vllm_specexpert.planner.prefetch.PrefetchPlanner`).
At layer l+1 the prediction is scored against the router, and run instead of it when the
miss policy speculates (or a mesh peer computed it ahead, ``no_stop``). Under a mesh,
predictions fire rows at peers instead of prefetching (:mod:`.mesh`).

What it hands other stages, as values of the call (:class:`~vllm_specexpert.pipeline.
DecodeCall`): ``prediction`` (made for this call), ``upcoming`` (made at it for the next
layer) and ``next_router_input`` (computes the next layer's estimated router input)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.pipeline import DecodeCall, Part, RouterFree, Stage
from vllm_specexpert.planner.bytes_judge import BytesJudge
from vllm_specexpert.planner.prefetch import PredictionCounters, PrefetchPlanner
from vllm_specexpert.planner.switch import MeasuredSwitch
from vllm_specexpert.predict import (
    PREDICTOR_CLASSES,
    LayerState,
    NextLayerRouting,
    Prediction,
    Predictor,
    PredictorInputs,
)
from vllm_specexpert.stats import Series


class PredictionFeature(EngineFeature):
    name = "prediction"
    inputs = ("predictor_inputs", "next_routing", "skippable_routers")

    def __init__(
        self,
        parts: EngineParts,
        predictor: Predictor,
        next_routing: dict[str, NextLayerRouting],
    ):
        self.predictor = predictor
        self.config = parts.config
        self.policy = parts.config.miss_policy_spec
        """The miss policy's traits."""
        self.layers = parts.layers
        self.link = parts.link
        self.next_routing = next_routing
        """Layer name -> how the next MoE layer routes (what is predicted from)."""
        self.prefetches = parts.config.mesh is None
        """Under a mesh, predictions fire rows at peers, not copies."""
        self.planners: dict[str, PrefetchPlanner] = {}
        """Layer name -> the precision of the predictions made for it, what to prefetch."""
        self.predictions: dict[str, Prediction] = {}
        """Layer name -> the prediction made for it earlier in the pass."""
        self.switch = (
            MeasuredSwitch("prefetch")
            if self.prefetches
            and parts.config.prefetch_governor
            and parts.config.prefetch_filter == "cost"
            and not self.policy.speculates
            else None
        )
        """Whether a pass's prefetch (under the cost filter) pays, measured per batch size;
        ``None`` where every prediction is prefetched (``speculate`` runs them, ``all``)."""
        self.judges_bytes = self.switch is not None and parts.config.disk is not None
        """On the disk tier, where bytes bind, each layer's prefetch also runs only while
        it reads no more than no prefetch would (:mod:`~vllm_specexpert.planner.bytes_judge`)."""
        self.prefetching = True
        """The switch's choice for the running pass."""
        self.first_index: int | None = None
        """The first MoE layer's index: its decode call starts a pass."""

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        predictor = PREDICTOR_CLASSES[parts.config.predictor]
        if predictor is None:
            return None
        made = predictor.build(inputs.get("predictor_inputs", PredictorInputs()))
        return cls(parts, made, inputs.get("next_routing", {}))

    @classmethod
    def check(cls, parts: EngineParts, inputs: Inputs) -> None:
        config = parts.config
        predictor = config.predictor_spec
        given: PredictorInputs = inputs.get("predictor_inputs", PredictorInputs())
        if predictor.needs_calibration and not given.default_vectors:
            raise SpecExpertConfigError(
                "predictor",
                f"{config.predictor} needs the calibration's default vectors, loaded at "
                "engine start",
                "start the engine with 'calibration' set",
            )
        if predictor.needs_estimator and given.estimator is None:
            raise SpecExpertConfigError(
                "predictor",
                f"{config.predictor} needs the estimator, loaded at engine start",
                "start the engine with 'estimator' set",
            )
        if config.router_free and not inputs.get("skippable_routers"):
            raise SpecExpertConfigError(
                "router_free",
                "skips routers in Python per call, and this engine's MoE runner is "
                "traced into torch.compile's graph (the CPU build's compiled mode)",
                "start the engine with enforce_eager=True (--enforce-eager), or remove it",
            )

    def equip(self, layer: OffloadedLayer) -> None:
        cache = layer.cache
        judge = BytesJudge(cache.num_experts, cache.num_slots) if self.judges_bytes else None
        self.planners[layer.name] = PrefetchPlanner(layer.top_k, judge)
        layer.add_counters(PredictionCounters)
        if self.first_index is None or layer.index < self.first_index:
            self.first_index = layer.index

    def unequip(self, layer: OffloadedLayer) -> None:
        layer.remove_counters(PredictionCounters)

    def stats(self) -> dict | None:
        """The prefetch switch's choice now and its measurements per batch bucket; on the
        disk tier, how many layers' prefetches the judge by bytes holds off now."""
        if self.switch is None:
            return None
        stats = {"prefetching": self.prefetching, "prefetch_switch": self.switch.stats()}
        if self.judges_bytes:
            stats["layers_judged_off"] = sum(not p.predicts for p in self.planners.values())
        return stats

    def series(self) -> list[Series]:
        """``specexpert_prefetch_seconds_per_token{batch, prefetch}``: the switch's
        measured medians per batch-size bucket, with its prefetches and without."""
        if self.switch is None:
            return []
        family = Series(
            "prefetch_seconds_per_token",
            "gauge",
            "Median wall seconds per decode token of recent passes of the batch-size "
            "bucket, with the prefetch (on) and without (off); the cheaper one runs.",
            ("batch", "prefetch"),
        )
        for batch, measured in self.switch.stats().items():
            for choice in ("on", "off"):
                value = measured[f"{choice}_s_per_token"]
                if value is not None:
                    family.add(value, batch, choice)
        return [family]

    def speculative(self, layer: OffloadedLayer) -> bool:
        """Whether the layer may run a prediction instead of its router's choice."""
        exact_layers = self.config.exact_layers
        return exact_layers is None or layer.index not in exact_layers

    def stages(self, layer: OffloadedLayer) -> Sequence[Part]:
        stages: list[Part] = [
            Stage("prediction.recall", "route", self._recall, makes=frozenset({"prediction"})),
            RouterFree(
                "prediction.router_free", functools.partial(self._routing_without_router, layer)
            ),
        ]
        if self.switch is not None and layer.index == self.first_index:
            stages.append(Stage("prediction.switch", "route", self._switch))
        stages += [
            Stage(
                "prediction.predict",
                "route",
                self._predict,
                makes=frozenset({"routing", "upcoming", "next_router_input"}),
                uses=frozenset({"prediction", "run_prediction", "exact"}),
            ),
            Stage(
                "prediction.score",
                "plan",
                self._score,
                uses=frozenset({"prediction", "upcoming"}),
            ),
        ]
        return stages

    def _switch(self, call: DecodeCall) -> None:
        """The first layer's call starts a pass: whether its prefetches pay."""
        assert self.switch is not None  # (a stage only with a switch)
        self.switch.step_started()
        self.prefetching = self.switch.on(call.num_tokens)
        self.switch.scheduled(call.num_tokens, decode_only=not call.request.mixed)

    def _recall(self, call: DecodeCall) -> None:
        """The prediction made for this layer earlier in the pass, if it fits the call."""
        prediction = self.predictions.pop(call.layer.name, None)
        if prediction is not None and prediction.num_tokens == call.num_tokens:
            call.prediction = prediction

    def _predict(self, call: DecodeCall) -> None:
        """Run the prediction instead of the router where the mode says so; predict the
        next layer."""
        layer, prediction = call.layer, call.prediction
        if prediction is not None and (
            (self.policy.speculates and self.speculative(layer)) or call.run_prediction
        ):
            weights, ids = prediction.routing_like(call.router_weights, call.router_ids)
            assert prediction.host_ids is not None  # (read at the call that made it)
            call.routing = (weights, ids, prediction.host_ids)
            counters = call.stats.part(PredictionCounters)
            counters.speculated_calls += not call.exact
            counters.router_free_calls += prediction.router_free
        routing = self.next_routing.get(layer.name)
        if layer.next_name is None or routing is None:
            return
        if not self.planners[layer.next_name].predicts:
            return  # (judged off by bytes: no prefetch to make it for)
        # Made now, on the device, so that its ids come to the host in the same read as
        # the router's.
        state = LayerState(call.x, call.run_ids, call.run_weights)
        upcoming = self.predictor.predict(state, layer.name, routing)
        call.read(upcoming.device_reads(), lambda host: upcoming.set_host(*host))
        call.upcoming = upcoming
        call.next_router_input = lambda: self.predictor.next_router_input(
            state, layer.name, routing
        )

    def _score(self, call: DecodeCall) -> None:
        """Score this layer's prediction; the next one's prefetch starts before the kernel."""
        prediction, upcoming = call.prediction, call.upcoming
        self.planners[call.layer.name].judge_call(
            call.layer.loader, call.router_host_ids, call.stats
        )
        if prediction is not None and not prediction.router_free:
            self.planners[call.layer.name].score(prediction, call.router_host_ids, call.stats)
        if upcoming is not None:
            call.first_launch.add(lambda: self._prefetch(call.layer, upcoming))

    def _prefetch(self, layer: OffloadedLayer, prediction: Prediction) -> None:
        """Record ``prediction`` for the next layer and submit its prefetch."""
        assert layer.next_name is not None  # (a layer with a successor predicts)
        self.predictions[layer.next_name] = prediction
        if not self.prefetches:
            return
        nxt = self.layers[layer.next_name]
        everything = self.config.prefetch_filter == "all" or (
            self.policy.speculates and self.speculative(nxt)
        )
        self.planners[nxt.name].prefetch(
            prediction,
            nxt.loader,
            nxt.stats.decode,
            self.link.expert_seconds(nxt.cache.experts),
            everything,
            submit=everything or self.prefetching,
        )

    def _routing_without_router(
        self, layer: OffloadedLayer, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``router_free``: the estimator's prediction, which ``speculate`` runs anyway."""
        prediction = self.predictions.get(layer.name)
        if (
            not self.config.router_free
            or prediction is None
            or not prediction.by_estimator
            or prediction.num_tokens != num_tokens
            or not self.policy.speculates
            or not self.speculative(layer)
        ):
            return None
        prediction.router_free = True
        return prediction.topk_weights, prediction.topk_ids

    def summary(self) -> str:
        """``hybrid``: after which MoE layers it runs the estimator."""
        layers = getattr(self.predictor, "estimator_layers", None)
        if self.config.predictor != "hybrid" or layers is None:
            return ""
        chosen = sorted(self.layers[name].index for name in layers)
        return f"; hybrid: the estimator after MoE layers {chosen}"


FEATURE = PredictionFeature
