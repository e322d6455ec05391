"""What a feature of the engine is: hooks that default to nothing, what it is built
from, and the decode call it acts on.

The engine (:mod:`vllm_specexpert.engine`) is the exact spine; everything else is an
:class:`EngineFeature` in the ordered registry of :mod:`vllm_specexpert.features`. Like
vLLM's ``BaseOffloader``, a feature overrides only the hooks it needs: the base class is
its own null object. A feature keeps its own per-layer state, keyed by layer name, and
declares the inputs it is built from (:attr:`EngineFeature.inputs`).

The hooks of one decode layer call, in order (docs/design.md, "The engine and its
features")::

    begin_call(call)      before anything is read
    before_read(call)     replace the routing to run; ask for tensors in the one read
    -- the one host read: the router's ids and what features asked for --
    after_read(call)      host values known: score, plan, add work before the kernel
    resolve(call, run, rest)  around the miss policy and the executor (first: outermost)
    end_call(call)        after the output exists
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.policy import MissPolicy
from vllm_specexpert.stats import PhaseStats, Series
from vllm_specexpert.tiers.link import Link
from vllm_specexpert.tiers.staging import HostReader
from vllm_specexpert.tiers.store import ExpertStore

HostReads = Callable[[list[np.ndarray]], None]
"""What a feature does with its device tensors once they are on the host."""


@dataclass
class DecodeCall:
    """One decode call of one offloaded MoE layer, as the features see it."""

    layer: OffloadedLayer
    request: LayerCall
    """The tokens, the router's routing on the device, the kernel."""
    stats: PhaseStats
    """The layer's decode counters."""
    replaced: tuple[torch.Tensor, torch.Tensor, np.ndarray] | None = None
    """The routing a feature runs instead of the router's (:meth:`replace_routing`):
    weights, ids, and the ids on the host."""
    exact: bool = False
    """Set at ``begin_call``: the call runs exactly (fetch, the router's routing)."""
    shared: dict[str, Any] = field(default_factory=dict)
    """What one feature hands a later one within the call (named by the giver)."""
    router_host_ids: np.ndarray = field(init=False)
    """The router's ids on the host (from ``after_read`` on)."""
    before_kernel: list[Callable[[], None]] = field(default_factory=list)
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
        """The routing's weights to run: the router's unless a feature replaced them."""
        return self.request.topk_weights if self.replaced is None else self.replaced[0]

    @property
    def run_ids(self) -> torch.Tensor:
        return self.request.topk_ids if self.replaced is None else self.replaced[1]

    def replace_routing(
        self, weights: torch.Tensor, ids: torch.Tensor, host_ids: np.ndarray
    ) -> None:
        """Run ``weights``/``ids`` (``host_ids`` on the host) instead of the router's."""
        self.replaced = (weights, ids, host_ids)

    def read(self, tensors: list[torch.Tensor], then: HostReads) -> None:
        """Bring ``tensors`` to the host in the call's one read; ``then`` gets them."""
        self._reads.append((tensors, then))

    def read_to_host(self, reader: HostReader) -> None:
        """The call's one host read: the router's ids (:attr:`router_host_ids`) and
        what the features asked for, each handed its part."""
        asked = [t for tensors, _ in self._reads for t in tensors]
        self.router_host_ids, *host = reader.read([self.request.topk_ids, *asked])
        at = 0
        for tensors, then in self._reads:
            then(host[at : at + len(tensors)])
            at += len(tensors)

    def layer_call(self) -> LayerCall:
        """What the executor runs: the routing to run, on the host too, and the work
        to start before the kernel."""
        hooks = self.before_kernel

        def before_kernel() -> None:
            for hook in hooks:
                hook()

        request, replaced = self.request, self.replaced
        weights, ids, host_ids = (
            (request.topk_weights, request.topk_ids, self.router_host_ids)
            if replaced is None
            else replaced
        )
        return dataclasses.replace(
            request,
            topk_weights=weights,
            topk_ids=ids,
            host_ids=host_ids,
            stats=self.stats,
            before_kernel=before_kernel if hooks else None,
        )


Resolve = Callable[[DecodeCall, LayerCall], torch.Tensor]
"""The rest of a decode call's resolution: (the call, what to run) -> its output."""

Inputs = Mapping[str, Any]
"""What the vLLM adapter handed the engine, by the names the features declare."""


@dataclass
class EngineParts:
    """What a feature is built with: the engine's parts under the config being run."""

    config: SpecExpertConfig
    layers: dict[str, OffloadedLayer]
    """Every offloaded MoE layer by name (a draft's target adds them after start)."""
    store: ExpertStore
    link: Link
    miss_policy: MissPolicy
    """The config's miss policy, before any feature wraps it."""
    lock: threading.Lock
    """Held while layers change or another thread reads them."""
    output: str
    """What the running mode does to the model's output (``OffloadEngine.output``)."""


class EngineFeature:
    """One feature of the engine: every hook does nothing (module doc)."""

    name: ClassVar[str] = "feature"
    """The feature's name, and its section in the engine's stats."""
    inputs: ClassVar[tuple[str, ...]] = ()
    """The adapter's inputs it is built from: a feature is built again when one of them
    is given (``OffloadEngine.provide`` refuses a name no feature declares)."""
    acts_on_resident_calls: ClassVar[bool] = False
    """Whether it must see the calls of a layer whose every expert is resident (else
    the engine composes that layer's call as the kernel alone, ``run_resident``)."""

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        """The feature if ``parts.config`` turns it on and its inputs are there
        (``None``: off, or built again once they arrive); ``built``: the features
        before it in the registry."""
        return None

    @classmethod
    def check(cls, parts: EngineParts, inputs: Inputs) -> None:
        """Raise a config error if ``parts.config`` needs of this feature what the loaded
        layers or ``inputs`` lack (at engine start and before a reconfigure)."""

    def reserved_slots(self, layer: OffloadedLayer, slots: int) -> int:
        """How many of the layer's ``slots`` the feature takes for itself (before its
        cache is made)."""
        return 0

    def equip(self, layer: OffloadedLayer) -> None:
        """Give a layer what the feature needs of it (after its cache is made: when the
        feature is built, and for a layer added later)."""

    def unequip(self, layer: OffloadedLayer) -> None:
        """Release what :meth:`equip` made for the layer (before it is equipped again)."""

    def miss_policy(self, policy: MissPolicy) -> MissPolicy:
        """The miss policy the engine runs, given the one before (a feature may wrap it:
        the mesh sends its peers' experts to them first)."""
        return policy

    def forces_exact(self, num_tokens: int) -> bool:
        """Whether a decode call of ``num_tokens`` tokens must run exactly now."""
        return False

    def begin_call(self, call: DecodeCall) -> None:
        """A decode call starts."""

    def before_read(self, call: DecodeCall) -> None:
        """Before the call's one host read."""

    def after_read(self, call: DecodeCall) -> None:
        """The router's ids (and what the features asked for) are on the host."""

    def resolve(self, call: DecodeCall, run: LayerCall, rest: Resolve) -> torch.Tensor:
        """Around the resolution of the call: ``rest(call, run)`` by default."""
        return rest(call, run)

    def end_call(self, call: DecodeCall) -> None:
        """The call's output exists."""

    def routing_for(
        self, layer: OffloadedLayer, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A routing the layer may run without calling its router (``router_free``)."""
        return None

    def stats(self) -> dict | None:
        """The feature's section of the engine's stats (``None``: none)."""
        return None

    def series(self) -> list[Series]:
        """Its series on ``/metrics``, as data (the collector there sees no feature)."""
        return []

    def summary(self) -> str:
        """Its part of the engine's one-line summary (``""``: none)."""
        return ""

    def reset_stats(self) -> None:
        """Its counters at zero."""

    def restart(self) -> None:
        """The engine went back to its start state (after vLLM's warm-up passes)."""

    def close(self) -> None:
        """Release what it holds (peers, threads)."""
