"""The lookahead draft (MoE-SpeQ) as an engine feature: the governor that sets each
step's draft length (:mod:`~vllm_specexpert.planner.governor`), and the target's planner
of the draft's routes (:mod:`~vllm_specexpert.planner.lookahead`), whose buffer becomes
the verification pass's demand (:mod:`.step_demand`). vLLM's speculative decoding runs
the draft; ``layers/lookahead_driver.py`` opens and closes its rounds around vLLM's
proposer, and the draft's layers hand their routes over (:meth:`draft_routed`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from vllm_specexpert.config.sections import LookaheadConfig
from vllm_specexpert.features.base import EngineFeature, EngineParts, Inputs
from vllm_specexpert.handoff import StepDemand
from vllm_specexpert.layer_state import OffloadedLayer
from vllm_specexpert.planner.governor import Governor
from vllm_specexpert.planner.lookahead import LookaheadPlanner
from vllm_specexpert.stats import LayerStats, Series


class LookaheadFeature(EngineFeature):
    name = "lookahead"
    inputs = ("draft",)

    def __init__(
        self,
        config: LookaheadConfig,
        layers: list[OffloadedLayer],
        draft: Any,
        lock: threading.Lock,
    ):
        self.governor = Governor(config.k_max, config.k, config.explore_after_tokens)
        self.draft = draft
        """The draft's engine (``None`` until vLLM has built the draft)."""
        self.lock = lock
        """The target engine's lock (the draft's routes arrive from its own layers)."""
        by_index = {layer.index: layer for layer in layers}
        self.planner = (
            LookaheadPlanner(layers[0].experts.num_experts, by_index.get)
            if draft is not None and layers
            else None
        )
        if draft is not None:  # its layers' routes come here (its ``draft_routes``)
            draft.provide(route_listener=self.draft_routed)

    @classmethod
    def build(
        cls, parts: EngineParts, inputs: Inputs, built: list[EngineFeature]
    ) -> EngineFeature | None:
        config = parts.config.lookahead
        if config is None:
            return None
        return cls(config, list(parts.layers.values()), inputs.get("draft"), parts.lock)

    @property
    def active(self) -> bool:
        """A drafting round runs (its routes are the target's lookahead)."""
        return self.planner is not None and self.planner.active

    def demand(self) -> StepDemand | None:
        """The running pass's demand: its requests' routes in their last rounds."""
        return self.planner.demand if self.planner is not None else None

    def step_demand(self) -> Callable[[], StepDemand | None]:
        return self.demand

    def begin_round(
        self, requests: list[str], verified: dict[str, tuple[int, int]], pass_s: float | None
    ) -> int:
        """A drafting round starts for ``requests``, after a target pass that verified
        ``verified`` (request -> drafted, accepted tokens) in ``pass_s`` seconds
        (``None``: not a verifying pass alone). Returns the round's draft length."""
        with self.lock:
            self.governor.verified(verified, requests, pass_s)
            k = self.governor.choose(requests)
            if self.planner is not None:
                if k:
                    self.planner.round_started(requests)
                else:  # (nothing drafted: the draft's routes are not the next pass's)
                    self.planner.round_skipped(requests)
        return k

    def draft_round(self, k: int) -> contextlib.AbstractContextManager[None]:
        """Around the draft's round of length ``k``. At ``k = 0`` its pass proposes
        nothing (it runs to keep the draft's KV cache): it runs none of its routed
        experts, so a step without drafts costs about what the target's alone does."""
        if k == 0 and self.draft is not None:
            return self.draft.experts_skipped()
        return contextlib.nullcontext()

    def end_round(self) -> None:
        """The round's draft has run (or failed): its routes are the next demand."""
        if self.planner is not None and self.planner.active:
            with self.lock:
                self.planner.round_ended()

    def drafted(self, requests: list[str], k: int, draft_s: float) -> set[str]:
        """The round drafted ``k`` tokens for ``requests`` in ``draft_s`` seconds: the
        requests whose drafts the governor keeps."""
        with self.lock:
            self.governor.drafted(requests, k, draft_s)
            return self.governor.drafting(requests, k)

    def pass_started(self, requests: Iterable[str], gone: Iterable[str]) -> None:
        """A target pass of ``requests`` starts; ``gone`` finished or were preempted
        since the last one."""
        if self.planner is not None:
            with self.lock:
                self.planner.pass_started(requests, gone)

    def first_rows(self, rows: np.ndarray) -> None:
        """The rows of the draft's first pass that stand for its requests (the others
        are the verified tokens' positions)."""
        if self.planner is not None:
            self.planner.buffer.first_rows = rows

    def draft_routed(self, layer_index: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """The draft's layer ``layer_index`` routed one pass (``[T, K]``): kept while a
        round runs (on CUDA, a sync)."""
        if self.planner is None or not self.planner.active:
            return
        host_ids, host_weights = ids.cpu().numpy(), weights.float().cpu().numpy()
        with self.lock:
            self.planner.draft_routed(layer_index, host_ids, host_weights)

    def stats(self) -> dict:
        """The governor's counters (draft length per step, acceptance) and the draft's
        memory and decodes."""
        result = self.governor.stats.to_dict()
        result["k_max"], result["fixed_k"] = self.governor.k_max, self.governor.fixed_k
        if self.draft is not None and self.draft.layers:
            with self.draft.lock:
                result["draft"] = _draft_stats(self.draft)
        return result

    def restart(self) -> None:
        if self.draft is not None:
            self.draft.restart()

    def reset_stats(self) -> None:
        self.governor.reset_stats()
        if self.draft is not None:
            self.draft.reset_stats()

    def series(self) -> list[Series]:
        """``specexpert_lookahead_*``: the governor's draft lengths and tokens."""
        stats = self.governor.stats.to_dict()
        steps = Series(
            "lookahead_steps",
            "counter",
            "Steps per draft length the lookahead governor chose.",
            ("k",),
        )
        for k, count in stats["steps_by_k"].items():
            steps.add(count, k)
        length = Series("lookahead_draft_length", "gauge", "The draft length chosen last.")
        if stats["last_k"] is not None:
            length.add(stats["last_k"])
        return [
            steps,
            length,
            Series(
                "lookahead_drafted_tokens", "counter", "Drafted tokens verified by the target."
            ).add(stats["drafted"]),
            Series(
                "lookahead_accepted_tokens", "counter", "Drafted tokens the target accepted."
            ).add(stats["accepted"]),
        ]


def _draft_stats(draft: Any) -> dict[str, Any]:
    # The target's writers run while the draft loads: skip a layer not yet equipped.
    layers = [layer for layer in draft.layers.values() if layer.equipped]
    totals = LayerStats.sum(layer.stats for layer in layers)
    return {
        "int4_bytes": draft.store.nbytes,
        "int4_memory_bytes": sum(layer.experts.memory_nbytes for layer in layers),
        # Packed: its slots hold INT4 experts as the GEMM reads them (disk, CPU build);
        # else bf16 ones, each load a decode.
        "computes_packed": bool(layers) and all(layer.experts.decoder is None for layer in layers),
        "slot_bytes": sum(
            layer.cache.num_slots * layer.cache.experts.slot_nbytes for layer in layers
        ),
        "loads": totals.decode.loads + totals.prefill.loads,
        "loaded_bytes": totals.decode.bytes_loaded + totals.prefill.bytes_loaded,
        # Where its time goes: waiting for its reads, and its kernel.
        "read_wait_s": totals.decode.stall_s + totals.prefill.stall_s,
        "kernel_s": totals.decode.kernel_s + totals.prefill.kernel_s,
    }


FEATURE = LookaheadFeature
