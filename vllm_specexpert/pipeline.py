"""One layer's call as a pipeline of stages, composed once (when the layer is equipped and
whenever the features change), as vLLM's ``FusedMoEModularKernel`` composes prepare →
experts → finalize.

A call runs, for each phase of its rows (decode first, then prompt rows)::

    on_call    every call, before the phase split: watch the router's routing
    route      decode: choose the routing to run; ask for tensors in the one host read
    -- the one host read: the router's ids and what the route stages asked for --
    plan       decode: host values known: score, plan what loads before the kernel
    run        load and launch, with the places: the miss policy's plan (``execute``),
               or, every expert resident, the kernel on the router's ids; a feature may
               wrap it (the quality budget runs the exact call beside it)
    finish     decode: after the output exists

A feature contributes its parts of the call (:data:`Part`), all from one hook: a
:class:`Stage` at ``on_call``, ``route``, ``plan`` or ``finish``; a :class:`RunWrap` of
``run``; an :class:`ExactDemand` (the call must run exactly now); a :class:`RouterFree`
routing (a pass may skip the router). Only those are composed, so a call loops over
nothing that has nothing to do. What passes between stages is a typed field of :class:`DecodeCall`;
each stage declares the fields it ``makes`` and ``uses``, and the stages of a step run in
an order that puts every maker before its users (the registry's order only breaks ties):
feature order never decides what a stage sees. The runners count what they run, each in
one place; the pipeline counts the call and its time.
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, final

import numpy as np
import torch

from vllm_specexpert import execute
from vllm_specexpert.device_runs import OneLaunch, device_run_for
from vllm_specexpert.device_runs.resident import launch_resident
from vllm_specexpert.handback import UnreadableRows
from vllm_specexpert.layer_call import NOTHING_FIRST, FirstLaunch, LayerCall
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.policy import MissPolicy
from vllm_specexpert.predict import Prediction
from vllm_specexpert.stats import PhaseStats
from vllm_specexpert.tiers.staging import HostReader, upload
from vllm_specexpert.tiers.store import ExpertsUnreadable

HostReads = Callable[[list[np.ndarray]], None]
"""What a stage does with its device tensors once they are on the host."""


@dataclass
class DecodeCall:
    """One decode call of one layer as the stages see it: what the adapter handed in, and
    the typed values stages hand each other (each names its maker and users)."""

    layer: OffloadedLayer
    request: LayerCall
    """The tokens, the router's routing on the device, the kernel."""
    stats: PhaseStats
    """The layer's decode counters."""
    exact: bool = False
    """The call runs exactly (fetch, the router's routing): a feature forces it."""
    routing: tuple[torch.Tensor, torch.Tensor, np.ndarray] | None = None
    """The routing to run instead of the router's (weights, ids, ids on the host).
    Made by ``prediction`` (``speculate``, ``no_stop``)."""
    prediction: Prediction | None = None
    """The prediction made for this layer earlier in the pass. Made by ``prediction``;
    used by ``prediction`` (score, run it) and ``mesh`` (early fire)."""
    run_prediction: bool = False
    """Run :attr:`prediction` instead of the router (rows were sent for it ahead).
    Made by ``mesh`` (``no_stop``); used by ``prediction``."""
    upcoming: Prediction | None = None
    """The next layer's prediction, made at this call. Made by ``prediction``; used by
    ``prediction`` (its prefetch) and ``mesh`` (rows sent ahead)."""
    next_router_input: Callable[[], torch.Tensor] | None = None
    """Computes the next layer's estimated router input. Made by ``prediction``; used by
    ``mesh``."""
    router_host_ids: np.ndarray = field(init=False)
    """The router's ids on the host (from the ``plan`` step on)."""
    first_launch: FirstLaunch = field(default_factory=FirstLaunch)
    """Work to start once the call's first launch has its experts, before it runs
    (a prefetch then overlaps the layer's own expert compute)."""
    _reads: list[tuple[list[torch.Tensor], HostReads]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens

    @property
    def x(self) -> torch.Tensor:
        """``[T, H]`` the tokens' router input."""
        return self.request.x

    @property
    def router_weights(self) -> torch.Tensor:
        return self.request.topk_weights

    @property
    def router_ids(self) -> torch.Tensor:
        return self.request.topk_ids

    @property
    def run_weights(self) -> torch.Tensor:
        """The routing's weights to run: the router's unless a stage replaced them."""
        return self.request.topk_weights if self.routing is None else self.routing[0]

    @property
    def run_ids(self) -> torch.Tensor:
        return self.request.topk_ids if self.routing is None else self.routing[1]

    def read(self, tensors: list[torch.Tensor], then: HostReads) -> None:
        """Bring ``tensors`` to the host in the call's one read; ``then`` gets them."""
        self._reads.append((tensors, then))

    def read_to_host(self, reader: HostReader) -> None:
        """The call's one host read: the router's ids (:attr:`router_host_ids`) and
        what the stages asked for, each handed its part."""
        asked = [t for tensors, _ in self._reads for t in tensors]
        self.router_host_ids, *host = reader.read([self.request.topk_ids, *asked])
        at = 0
        for tensors, then in self._reads:
            then(host[at : at + len(tensors)])
            at += len(tensors)

    def layer_call(self) -> LayerCall:
        """What the run step runs: the routing to run, on the host too, and the work
        to start before the first launch."""
        request = self.request
        weights, ids, host_ids = (
            (request.topk_weights, request.topk_ids, self.router_host_ids)
            if self.routing is None
            else self.routing
        )
        return dataclasses.replace(
            request,
            topk_weights=weights,
            topk_ids=ids,
            host_ids=host_ids,
            stats=self.stats,
            first_launch=self.first_launch if self.first_launch.pending else NOTHING_FIRST,
        )


CALL_VALUES = frozenset(
    f.name
    for f in dataclasses.fields(DecodeCall)
    if f.name not in ("layer", "request", "stats") and not f.name.startswith("_")
)
"""The values a stage may declare it makes or uses."""

Step = Literal["on_call", "route", "plan", "finish"]
STEPS: tuple[Step, ...] = ("on_call", "route", "plan", "finish")


@dataclass(frozen=True)
class Stage:
    """One step's work of one feature. ``run`` takes the :class:`DecodeCall` (``on_call``:
    the :class:`LayerCall` as the adapter handed it, before the phase split)."""

    name: str
    """``feature.what``: in errors and in :meth:`LayerPipeline.describe`."""
    step: Step
    run: Callable[[Any], None]
    """Takes a :class:`DecodeCall`; at ``on_call``, a :class:`LayerCall`."""
    makes: frozenset[str] = frozenset()
    uses: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.step not in STEPS:
            raise ValueError(f"stage {self.name}: step {self.step!r} is not one of {STEPS}")
        unknown = sorted((self.makes | self.uses) - CALL_VALUES)
        if unknown:
            raise ValueError(
                f"stage {self.name}: {unknown} are not values of a call "
                f"(DecodeCall's fields: {sorted(CALL_VALUES)})"
            )


def ordered(stages: Sequence[Stage]) -> list[Stage]:
    """``stages`` (of one step) with every maker of a value before its users, the given
    order kept otherwise. Raises on a cycle."""
    left = list(stages)
    done: list[Stage] = []
    while left:
        ready = next(
            (
                stage
                for stage in left
                if not any(other is not stage and other.makes & stage.uses for other in left)
            ),
            None,
        )
        if ready is None:
            names = ", ".join(stage.name for stage in left)
            raise ValueError(f"the stages {names} make and use each other's values: no order")
        done.append(ready)
        left.remove(ready)
    return done


class Runner(ABC):
    """The run step: the routed experts' output of what to run (a :class:`LayerCall`),
    given the decode call it belongs to, or ``None`` for prompt rows."""

    @abstractmethod
    def run(self, call: DecodeCall | None, request: LayerCall) -> torch.Tensor: ...


@dataclass(frozen=True)
class RunWrap:
    """A feature's wrap of the run step (the first feature's is the outermost)."""

    name: str
    wrap: Callable[[Runner, Runner], Runner]
    """(the mode's runner, the exact one) -> the runner."""


@dataclass(frozen=True)
class ExactDemand:
    """What tells whether a decode call of some tokens must run exactly now
    (:attr:`DecodeCall.exact`; and then no pass skips the router)."""

    name: str
    now: Callable[[int], bool]
    """Of a call of so many tokens."""


@dataclass(frozen=True)
class RouterFree:
    """A routing a decode pass may run without the layer's router (``router_free``)."""

    name: str
    routing: Callable[[int], tuple[torch.Tensor, torch.Tensor] | None]
    """For a pass of so many tokens; ``None``: call the router."""


Part = Stage | RunWrap | ExactDemand | RouterFree
"""What a feature adds to a layer's call (:meth:`EngineFeature.stages`)."""


class ExactRun(Runner):
    """The router's experts, missing ones loaded on demand (prompt rows, ``fetch``)."""

    def __init__(self, layer: OffloadedLayer, device: OneLaunch) -> None:
        self.device, self.loader = device, layer.loader

    def run(self, call: DecodeCall | None, request: LayerCall) -> torch.Tensor:
        return self.device.run_all(self.loader, request)


class PlannedRun(Runner):
    """The miss policy's plan for what is missing (only if something is), carried out."""

    def __init__(self, layer: OffloadedLayer, policy: MissPolicy, device: OneLaunch) -> None:
        self.device, self.loader, self.policy, self.layer = device, layer.loader, policy, layer

    def run(self, call: DecodeCall | None, request: LayerCall) -> torch.Tensor:
        context = self.layer.miss_context
        return execute.resolve(self.device, self.loader, request, self.policy, context)


class ResidentRun(Runner):
    """Every expert in the slot of its id: one launch on the ids as they are."""

    def __init__(self, layer: OffloadedLayer) -> None:
        self.loader = layer.loader

    def run(self, call: DecodeCall | None, request: LayerCall) -> torch.Tensor:
        return launch_resident(self.loader, request)


@final
class LayerPipeline:
    """One layer's composed call (module doc). Built by :func:`compose`."""

    def __init__(
        self,
        layer: OffloadedLayer,
        device: OneLaunch,
        stages: dict[Step, list[Stage]],
        decode: Runner,
        prefill: Runner,
        reader: HostReader,
        unreadable: UnreadableRows,
        others: Sequence[RunWrap | ExactDemand | RouterFree] = (),
        reads_ids: bool = True,
    ):
        self.layer = layer
        self.device = device
        """The layer's device run where its experts are not all resident (the
        unreadable experts' rerun takes it too)."""
        self.stages = stages
        self.others = list(others)
        """The parts that are not a step's stages (already in ``decode``: its wraps)."""
        self.decode_runner = decode
        self.prefill_runner = prefill
        self.reader = reader
        self.unreadable = unreadable
        self._on_call = [stage.run for stage in stages["on_call"]]
        self._route = [stage.run for stage in stages["route"]]
        self._plan = [stage.run for stage in stages["plan"]]
        self._finish = [stage.run for stage in stages["finish"]]
        self._exact_now = [part.now for part in others if isinstance(part, ExactDemand)]
        wrapped = any(isinstance(part, RunWrap) for part in others)
        self._staged = bool(self._route or self._plan or self._finish or self._exact_now or wrapped)
        """A decode call as a :class:`DecodeCall` where some stage or wrapper takes one;
        else the runner gets the request as it is (decided here, once)."""
        self._reads_ids = reads_ids
        """Whether the runner needs the ids on the host (not to launch on them as
        they are)."""
        self._router_free = [part.routing for part in others if isinstance(part, RouterFree)]

    def routing_without_router(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``router_free``: the routing a decode-only pass of ``tokens`` tokens runs
        without calling the layer's router, or ``None``: call the router (also while a
        call of that many tokens must run exactly)."""
        if not self._router_free or any(now(tokens) for now in self._exact_now):
            return None
        routings = (source(tokens) for source in self._router_free)
        return next((routing for routing in routings if routing is not None), None)

    def describe(self) -> dict[str, list[str]]:
        """Step -> its stages' names, in the order they run; ``others``: the other parts'."""
        steps = {step: [stage.name for stage in stages] for step, stages in self.stages.items()}
        return steps | {"others": [part.name for part in self.others]}

    def run(self, request: LayerCall) -> torch.Tensor:
        """The routed experts' output of one call; when the slow tier cannot supply some
        of its experts, the call again without them (:func:`execute.execute_without`),
        so that the pass goes on."""
        started = time.perf_counter()
        for watch in self._on_call:
            watch(request)
        phases, stats = request.phases, self.layer.stats
        decode_only = phases is None or not len(phases.prefill)
        counted = stats.decode if phases is None or len(phases.decode) else stats.prefill
        try:
            out = self._decode(request) if decode_only else self._by_phase(request)
        except ExpertsUnreadable as error:
            again = request.on_host(counted)
            out = execute.execute_without(
                self.device, self.layer.loader, again, error, self.unreadable
            )
        counted.call_s += time.perf_counter() - started
        return out

    def _by_phase(self, request: LayerCall) -> torch.Tensor:
        """Prompt rows alone, or a mixed pass (chunked prefill beside decoding requests):
        decode rows first, so that what was loaded ahead for them is released by their
        own call; then the prompt rows, whose experts go before the decode set's."""
        phases = request.phases
        assert phases is not None  # (a pass of decode rows only is not split)
        if not len(phases.decode):
            return self._prefill(request)
        out = torch.empty_like(request.x)
        out[upload(phases.decode, request.x.device)] = self._decode(request.rows(phases.decode))
        with self.layer.cache.frozen_recency():
            out[upload(phases.prefill, request.x.device)] = self._prefill(
                request.rows(phases.prefill)
            )
        return out

    def _prefill(self, request: LayerCall) -> torch.Tensor:
        """The router's experts, exactly. On CUDA the host read is the sync on-demand
        loading cannot avoid: what to copy is known once the router ran."""
        return self.prefill_runner.run(None, self._taken(request, self.layer.stats.prefill))

    def _taken(self, request: LayerCall, stats: PhaseStats) -> LayerCall:
        """``request`` (this call's own: taken in place) counted as a call of ``stats``,
        its ids read to the host if the runner needs them."""
        stats.calls += 1  # (count_call, inline: the resident path's cost is the overhead)
        stats.tokens += request.x.shape[0]
        request.stats = stats
        if self._reads_ids:
            (request.host_ids,) = self.reader.read([request.topk_ids])
        return request

    def _decode(self, request: LayerCall) -> torch.Tensor:
        """Decode rows: through the steps, or, with none composed, straight to the runner."""
        return self._decode_staged(request) if self._staged else self._decode_bare(request)

    def _decode_bare(self, request: LayerCall) -> torch.Tensor:
        # (_taken, inline: this is the resident path, whose cost is the plugin's overhead)
        stats = request.stats = self.layer.stats.decode
        stats.calls += 1
        stats.tokens += request.x.shape[0]
        if self._reads_ids:
            (request.host_ids,) = self.reader.read([request.topk_ids])
        return self.decode_runner.run(None, request)

    def _decode_staged(self, request: LayerCall) -> torch.Tensor:
        stats = self.layer.stats.decode.count_call(request.x.shape[0])
        call = DecodeCall(self.layer, request, stats)
        call.exact = any(now(call.num_tokens) for now in self._exact_now)
        for stage in self._route:
            stage(call)
        call.read_to_host(self.reader)
        for stage in self._plan:
            stage(call)
        try:
            return self.decode_runner.run(call, call.layer_call())
        finally:  # (also when an expert could not be read: the call runs again without)
            for stage in self._finish:
                stage(call)


def compose(
    layer: OffloadedLayer,
    policy: MissPolicy,
    parts: Sequence[Part],
    reader: HostReader,
    unreadable: UnreadableRows,
) -> LayerPipeline:
    """The layer's pipeline: with every expert in the slot of its id (``cache.identity``)
    the runners launch on the router's ids as they are; else decode rows run the miss
    policy's plan (a policy that never plans, ``fetch``, ``stream``: the exact runner)
    and prompt rows the exact runner. ``parts`` are the features', in the
    registry's order."""
    device = device_run_for(policy.spec.splits_tokens)
    decode: Runner
    prefill: Runner
    exact: Runner
    if layer.cache.identity:
        decode = prefill = exact = ResidentRun(layer)
    else:
        prefill = exact = ExactRun(layer, device)
        decode = PlannedRun(layer, policy, device) if policy.plans else prefill
    stages = [part for part in parts if isinstance(part, Stage)]
    others = [part for part in parts if not isinstance(part, Stage)]
    for part in reversed(others):  # (the first in the registry's order: outermost)
        if isinstance(part, RunWrap):
            decode = part.wrap(decode, exact)
    by_step = {step: ordered([s for s in stages if s.step == step]) for step in STEPS}
    return LayerPipeline(
        layer,
        device,
        by_step,
        decode,
        prefill,
        reader,
        unreadable,
        others,
        reads_ids=not layer.cache.identity,
    )
