"""The engine of the tests that do not start vLLM: an :class:`OffloadEngine` on the CPU
over toy layers (``moe_reference.random_layer``). Tests build it through conftest's
``toy_engines`` fixture, which takes :func:`build_engine`'s arguments and closes every
engine it built when the test ends (each engine holds a link's copy thread, and a stats
writer's with a ``stats_path``); each test file binds its own toy model (layers, top-k,
default config) in a fixture on it. :func:`build_engine` is the plain function under
that fixture, for code that is not a test; what it returns is the caller's to close."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import ClassVar

import torch

from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.handoff import StepDemand
from vllm_specexpert.tiers.host import HostKernel


def build_engine(
    config: dict | SpecExpertConfig,
    layers: Mapping[str, dict[str, torch.Tensor]],
    top_k: int,
    *,
    indices: Sequence[int] | None = None,
    host_kernel: HostKernel | None = None,
    reports: bool = True,
    start: bool = True,
    pool_reach: int | None = None,
    max_num_seqs: int = 0,
    slots_deferred: bool = False,
) -> OffloadEngine:
    """An engine on the CPU with ``layers`` (name -> expert tensors) added in order, at
    decoder-layer ``indices`` (default 0, 1, ...). Started unless ``start`` is False:
    what the vLLM adapter wires between the layers and the start (routing statistics,
    a logit head, predictor inputs, peers, the next layer's router) is the caller's;
    so is the quality budget (a dict ``config`` without ``quality`` runs none).
    ``pool_reach``: the elements a slot tensor may hold (the expert kernel's reach).
    ``max_num_seqs``: vLLM's, which sizes the shared region (0: unknown, none).
    ``slots_deferred``: the layers get no slots until ``equip_deferred`` (a draft's).
    An engine that fails to be built (a layer refused, a failed start) is closed here:
    no caller gets it to close."""
    if not isinstance(config, SpecExpertConfig):
        # A toy model has no final norm to tap (no logit head): no quality budget unless
        # the test gives one (and then provides the head, as wiring a model does).
        config = SpecExpertConfig.from_dict({"quality": None, **config})
    engine = OffloadEngine(
        config, torch.device("cpu"), reports=reports, slots_deferred=slots_deferred
    )
    engine.budget.sizing.moe_layers = len(layers)  # (vLLM's adapter counts them as it builds them)
    engine.budget.sizing.max_num_seqs = max_num_seqs
    try:
        indices = range(len(layers)) if indices is None else indices
        for index, (name, tensors) in zip(indices, layers.items(), strict=True):
            engine.add_layer(
                name,
                tensors,
                top_k=top_k,
                index=index,
                host_kernel=host_kernel,
                pool_reach=pool_reach,
            )
        if start:
            engine.start()
    except BaseException:
        engine.close()
        raise
    return engine


@contextmanager
def closing_engines() -> Iterator[Callable[..., OffloadEngine]]:
    """:func:`build_engine` for one block: every engine it built is closed when the block
    ends, however it ends (conftest's ``toy_engines`` is this, for one test)."""
    built = []

    @functools.wraps(build_engine)
    def build(*args, **kwargs) -> OffloadEngine:
        engine = build_engine(*args, **kwargs)
        built.append(engine)
        return engine

    try:
        yield build
    finally:
        for engine in reversed(built):
            engine.close()


class DemandSource:
    """The scheduler's step demand as a test hands it to one toy engine (the adapter
    provides ``handoff.current`` instead): ``DemandSource.of(engine).demand = ...``."""

    _sources: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()

    def __init__(self, engine: OffloadEngine) -> None:
        self.demand: StepDemand | None = None
        engine.provide(step_demand=lambda: self.demand)

    @classmethod
    def of(cls, engine: OffloadEngine) -> DemandSource:
        if engine not in cls._sources:
            cls._sources[engine] = cls(engine)
        return cls._sources[engine]
