"""The predictor interface: before layer l's experts run, guess layer l+1's routing.

A predictor only estimates layer l+1's router input ``q`` from what layer l has; the
next layer's own router (a :class:`NextLayerRouting`, from the vLLM adapter or the
offline analysis) turns it into ids and weights, so it routes as the model would.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm_specexpert.predict.estimator_network import ExpertEstimator
    from vllm_specexpert.triton_kernels.predict import QuasiHiddenTerms


@dataclass
class LayerState:
    """What layer l knows once its router has run, for one batch of tokens."""

    router_input: torch.Tensor
    """``s_l [T, H]``: the normalized residual fed to layer l's router and experts."""
    topk_ids: torch.Tensor
    """``[T, K]`` experts layer l runs (router-chosen, or predicted under ``speculate``)."""
    topk_weights: torch.Tensor
    """``[T, K]`` their gate weights."""


@dataclass
class FusedRouting:
    """Layer l+1's routing (RMSNorm, gate, softmax, top-k) as tensors, for the one-launch
    Triton predictor (:mod:`vllm_specexpert.triton_kernels.predict`)."""

    gate_weight: torch.Tensor
    """``[E, H]`` the gate's weight (device, model dtype)."""
    norm_weight: torch.Tensor
    """``[H]`` ``LN_{l+1}``'s weight."""
    eps: float
    top_k: int
    renormalize: bool
    """Top-k weights divided by their sum (``norm_topk_prob``)."""


@dataclass
class NextLayerRouting:
    """Layer l+1's routing, as callables over ``[T, H]`` tensors."""

    norm: Callable[[torch.Tensor], torch.Tensor]
    """``LN_{l+1}``: the normalization applied to the residual before its router."""
    route: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    """Router input -> ``(topk_weights, topk_ids)``, as the model routes."""
    fused: FusedRouting | None = None
    """Set when the routing is plain softmax top-k on a device with Triton (CUDA): the
    predictor then runs as one kernel launch instead of ``norm`` and ``route``."""
    route_logits: (
        Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None
    ) = None
    """``(router input [T, H], router logits [T, E]) -> (topk_weights, topk_ids)``: the
    model's expert selection from logits someone else computed (``estimator``)."""


@dataclass
class Prediction:
    """Predicted routing of layer l+1 for the tokens of one batch."""

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    made_at: float = 0.0
    """``time.perf_counter()`` when the prediction was made."""
    considered: np.ndarray | None = None
    """``[T, K]`` (like :meth:`ranked`): entries that were candidates for a prefetch
    (not resident when predicted), set by the engine."""
    host_ids: np.ndarray | None = None
    """``topk_ids`` on the host, read with the router's ids (one read per layer call)."""
    host_weights: np.ndarray | None = None
    """``topk_weights`` on the host as float32, once read."""
    router_input: torch.Tensor | None = None
    """``q [T, H]`` the ids came from; ``None`` from the Triton predictor
    (:meth:`Predictor.next_router_input` gives it)."""
    by_estimator: bool = False
    """Made by the neural estimator (``router_free`` skips such a layer's router)."""
    router_free: bool = False
    """The layer ran it without its router (``router_free``): nothing to score against."""
    _ranked: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[0]

    def routing_like(
        self, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The predicted routing in the router's dtypes: what a layer runs instead of
        its router's (``speculate``, mesh ``no_stop``)."""
        return self.topk_weights.to(topk_weights.dtype), self.topk_ids.to(topk_ids.dtype)

    def device_reads(self) -> list[torch.Tensor]:
        """What :meth:`set_host` takes, as device tensors to read."""
        return [self.topk_ids, self.topk_weights.float()]

    def set_host(self, ids: np.ndarray, weights: np.ndarray) -> None:
        self.host_ids, self.host_weights = ids.astype(np.int64, copy=False), weights

    def _host(self) -> tuple[np.ndarray, np.ndarray]:
        if self.host_ids is None:  # not read by the engine (offline analysis): read now
            self.set_host(*(t.cpu().numpy() for t in self.device_reads()))
        assert self.host_ids is not None and self.host_weights is not None  # set_host's
        return self.host_ids, self.host_weights

    def ranked(self) -> np.ndarray:
        """``[T, K]`` predicted ids on the host, by predicted weight, best first."""
        if self._ranked is None:
            ids, weights = self._host()
            order = np.argsort(-weights, axis=-1, kind="stable")
            self._ranked = np.take_along_axis(ids, order, axis=-1)
        return self._ranked

    def experts_by_mass(self) -> np.ndarray:
        """Distinct predicted experts, most predicted gate mass first (host int64)."""
        ids, weights = self._host()
        ids, mass = ids.reshape(-1), weights.reshape(-1)
        experts = np.flatnonzero(np.bincount(ids))
        totals = np.bincount(ids, weights=mass)[experts]
        return experts[np.argsort(-totals, kind="stable")]


@dataclass
class PredictorInputs:
    """What the artifacts read at engine start give the predictors, by layer name."""

    default_vectors: dict[str, torch.Tensor] = field(default_factory=dict)
    """``[E, H]`` default vectors of each layer (the calibration; ``quasi_hidden``)."""
    residual_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    """``[H]`` scale turning ``s_l`` back into ``r_l`` (the calibration)."""
    estimator: ExpertEstimator | None = None
    """The neural expert estimator (``estimator``, ``hybrid``)."""
    estimator_layers: dict[str, int] = field(default_factory=dict)
    """Layer l's name -> the estimator's transition index."""
    hybrid_layers: frozenset[str] = frozenset()
    """Layers after which ``hybrid`` runs the estimator (chosen by ``analysis``)."""

    def to(self, device: torch.device) -> PredictorInputs:
        return PredictorInputs(
            {n: v.to(device) for n, v in self.default_vectors.items()},
            {n: v.to(device) for n, v in self.residual_scales.items()},
            None if self.estimator is None else self.estimator.to(device),
            dict(self.estimator_layers),
            self.hybrid_layers,
        )


class Predictor(ABC):
    """Estimates layer l+1's router input from layer l's state."""

    name: str

    @classmethod
    def build(cls, inputs: PredictorInputs) -> Predictor:
        """The predictor, given what the artifacts gave each layer."""
        return cls()

    @abstractmethod
    def next_router_input(
        self, state: LayerState, layer: str, nxt: NextLayerRouting
    ) -> torch.Tensor:
        """``q [T, H]``, the estimate of ``s_{l+1}``; ``layer`` names layer l."""

    @abstractmethod
    def fused_terms(
        self, state: LayerState, layer: str, fused: FusedRouting
    ) -> QuasiHiddenTerms | None:
        """What :func:`~vllm_specexpert.triton_kernels.predict.predict_routing` adds to
        the router input: a ``QuasiHiddenTerms``, or ``None`` (the input as it is)."""

    def predict(self, state: LayerState, layer: str, nxt: NextLayerRouting) -> Prediction:
        if nxt.fused is not None:
            from vllm_specexpert.triton_kernels.predict import predict_routing

            fused = nxt.fused
            weights, ids = predict_routing(
                state.router_input,
                fused.gate_weight,
                fused.top_k,
                fused.renormalize,
                self.fused_terms(state, layer, fused),
            )
        else:
            q = self.next_router_input(state, layer, nxt)
            weights, ids = nxt.route(q)
            return Prediction(topk_weights=weights, topk_ids=ids, router_input=q)
        return Prediction(topk_weights=weights, topk_ids=ids)
