"""``router_free``: a decode pass skips the router of a layer whose routing the neural
estimator already predicted, when ``speculate`` will run that prediction anyway
(speculating-experts §6: with an estimator, the router is no longer needed to choose
the experts).

vLLM's ``MoERunner`` applies the gate (when it holds it: Qwen3-MoE, DeepSeek-V2) and then
``router.select_experts``. Both are wrapped on the instance: when the engine hands back a
routing (:meth:`~vllm_specexpert.pipeline.LayerPipeline.routing_without_router`), the gate
returns an unused buffer instead of computing logits and the selection returns the
prediction. Models whose forward applies the gate itself (Mixtral, OLMoE, GPT-OSS) skip
the selection only.

The decision is taken in Python per call, so the wrappers are installed only where the
runner runs eagerly: with ``enforce_eager``, or on CUDA, where the runner is vLLM's
opaque ``moe_forward`` op. On the CPU build's compiled mode torch.compile traces the
runner into the model's graph, where the decision would be frozen at trace time; moving
it into an opaque op of its own was tried and changed the compiled graph's fusions, hence
the last bits of exact modes' output. There ``router_free`` is refused at start.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_specexpert.layers.forward_phase import current_phases


class RouterFreeHook:
    """Wraps one MoE layer's gate and expert selection (see module doc)."""

    def __init__(self, runner: Any, routed: Any) -> None:
        # (vLLM's MoERunner and the layer's OffloadedRoutedExperts, read by attribute)
        self.routed = routed  # the layer's OffloadedRoutedExperts
        routed.router_free_hook = self
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.select_experts = runner.router.select_experts
        runner.router.select_experts = self.select
        self.gate = runner.gate
        if self.gate is not None:
            self.gate_forward = self.gate.forward
            self.gate.forward = self.gate_call

    def routing(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        tokens = hidden.shape[0]
        if not current_phases(tokens, self.routed.decode_query_len).all_decode:
            return None
        return self.routed.engine.pipelines[self.routed.layer_name].routing_without_router(tokens)

    def gate_call(
        self, hidden: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.pending = self.routing(hidden)
        if self.pending is None:
            return self.gate_forward(hidden, *args, **kwargs)
        # The runner passes the logits on to the selection, which ignores them.
        return hidden.new_empty(hidden.shape[0], self.gate.weight.shape[0]), None

    def select(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        routing = self.pending if self.gate is not None else self.routing(hidden_states)
        self.pending = None
        if routing is None:
            return self.select_experts(
                hidden_states=hidden_states, router_logits=router_logits, **kwargs
            )
        return routing


def runner_is_eager(vllm_config: Any = None) -> bool:
    """Whether vLLM runs the MoE runner's Python per call under ``vllm_config`` (the
    current one by default; see module doc)."""
    from vllm.config import CompilationMode, get_current_vllm_config
    from vllm.platforms import current_platform

    mode = (vllm_config or get_current_vllm_config()).compilation_config.mode
    return not current_platform.is_cpu() or mode == CompilationMode.NONE
