"""The lookahead draft's routes handed to its target, as a feature of the draft's engine:
every call of a draft layer gives its router's routing to the listener the target's
``lookahead`` provides (``route_listener``), which keeps it while a drafting round runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.pipeline import Stage

RouteListener = Callable[[int, torch.Tensor, torch.Tensor], None]
"""``listener(layer_index, topk_ids, topk_weights)``: a call's routing, on the device."""


class DraftRoutesFeature(EngineFeature):
    name = "draft_routes"
    inputs = ("route_listener",)

    def __init__(self, listener: RouteListener, layers: dict[str, OffloadedLayer]):
        self.listener = listener
        self.layers = layers

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        listener = inputs.get("route_listener")
        return cls(listener, parts.layers) if listener is not None else None

    def stages(self, layer: OffloadedLayer) -> Sequence[Stage]:
        index = layer.index

        def hand_over(request: LayerCall) -> None:
            self.listener(index, request.topk_ids, request.topk_weights)

        return (Stage("draft_routes.hand_over", "on_call", hand_over),)


FEATURE = DraftRoutesFeature
