"""The ``estimator`` and ``hybrid`` predictors: the neural expert estimator
(:mod:`.estimator_network`, speculating-experts §6.1) predicts layer l+1's routing from
q_l, after every MoE layer (``estimator``) or after the layers whose next layer
``quasi_hidden`` predicts worst, by ``specexpert analyze`` (``hybrid``; ``quasi_hidden``
after the others)."""

from __future__ import annotations

import torch

from vllm_specexpert.predict.base import (
    LayerState,
    NextLayerRouting,
    Prediction,
    PredictorInputs,
)
from vllm_specexpert.predict.quasi_hidden import QuasiHiddenPredictor


class EstimatorPredictor(QuasiHiddenPredictor):
    """``estimator``: q_l as ``quasi_hidden`` makes it, then the network's logits
    instead of layer l+1's gate (the model's own selection picks the top-k from them)."""

    name = "estimator"

    def __init__(self, inputs: PredictorInputs, layers: dict[str, int]) -> None:
        super().__init__(inputs.default_vectors, inputs.residual_scales)
        self.estimator = inputs.estimator
        self.estimator_layers = dict(layers)
        """Layer l's name -> transition index, after the layers it runs."""

    @classmethod
    def build(cls, inputs: PredictorInputs) -> EstimatorPredictor:
        return cls(inputs, inputs.estimator_layers)

    def predict(self, state: LayerState, layer: str, nxt: NextLayerRouting) -> Prediction:
        transition = self.estimator_layers.get(layer)
        if transition is None:
            return super().predict(state, layer, nxt)
        # Only layers with a transition of the estimator are in estimator_layers.
        assert self.estimator is not None, "estimator_layers without an estimator"
        q = self.next_router_input(state, layer, nxt)
        if nxt.fused is not None:  # CUDA, plain softmax top-k: the network in one launch
            from vllm_specexpert.triton_kernels.estimate import estimate_routing

            weights, ids = estimate_routing(
                q, self.estimator, transition, nxt.fused.top_k, nxt.fused.renormalize
            )
        else:
            assert nxt.route_logits is not None, "no expert selection from logits given"
            with torch.no_grad():
                logits = self.estimator(q.float(), transition)
            weights, ids = nxt.route_logits(q, logits)
        return Prediction(topk_weights=weights, topk_ids=ids, router_input=q, by_estimator=True)


class HybridPredictor(EstimatorPredictor):
    """``hybrid`` (Hybrid-PF): the estimator after the layers chosen by ``analysis``
    (:mod:`vllm_specexpert.predict.hybrid`), ``quasi_hidden`` after the others."""

    name = "hybrid"

    @classmethod
    def build(cls, inputs: PredictorInputs) -> HybridPredictor:
        return cls(
            inputs,
            {
                name: j
                for name, j in inputs.estimator_layers.items()
                if name in inputs.hybrid_layers
            },
        )
