"""The token scheduler (ExpertFlow §3.3) as a subclass of vLLM's V1 scheduler.

Installed as ``scheduler_cls`` when the config has a ``path_predictor``. It runs in the
engine-core process, where the token ids are, so the path predictor runs before the
batch is formed with no extra IPC (from the worker, its prediction would come a step
late under async scheduling). Each step's predicted demand goes to the workers
(:mod:`vllm_specexpert.handoff`). With ``token_scheduler``, when more than ``group_size``
requests decode, :func:`~vllm_specexpert.schedule.grouping.partition` splits them by
predicted route; the first group (the longest-waiting, and every one waiting
``max_wait_steps``) runs and the rest are held back a step with vLLM's
``next_decode_eligible_step`` (they keep their KV blocks). Prefill is never touched.
Its governor (a :class:`~vllm_specexpert.planner.switch.MeasuredSwitch`) groups only in
the batch sizes where grouping, measured, costs less time per decode token than running
every sequence.
Counters: :attr:`stats`, sent to the workers every step.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from vllm_specexpert import handoff
from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.handoff import SchedulerStats, StepDemand
from vllm_specexpert.log import init_logger
from vllm_specexpert.planner.switch import EXPLORE_AFTER_TOKENS, MeasuredSwitch
from vllm_specexpert.predict.path import load_path_predictor
from vllm_specexpert.schedule.grouping import partition
from vllm_specexpert.schedule.scheduler import SpecExpertScheduler

logger = init_logger(__name__)

SCHEDULER_CLS = f"{__name__}.TokenGroupScheduler"
"""What the plugin sets as vLLM's ``scheduler_cls``."""


class TokenGroupScheduler(SpecExpertScheduler):
    """vLLM's scheduler that predicts each step's experts for the workers and, under
    ``token_scheduler``, runs decode sequences in route-consolidated groups."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        config = SpecExpertConfig.from_additional_config(vllm_config.additional_config)
        if config is None or config.path_predictor is None:
            raise RuntimeError(
                "specexpert: its scheduler class predicts with a path "
                "predictor, and the engine's config sets none"
            )
        self.settings = config.token_scheduler
        self.path_predictor = load_path_predictor(config.path_predictor)
        self.waited: dict[str, int] = {}
        """Request id -> consecutive steps held back so far."""
        self._step_routes: dict[str, torch.Tensor] = {}
        """Request id -> its predicted route, this step."""
        self._next_group: list = []
        """The decode requests of the group expected to run next step."""
        self.stats = SchedulerStats()
        self.governor = (
            MeasuredSwitch("token scheduler's grouping", explore_after_tokens=EXPLORE_AFTER_TOKENS)
            if self.settings is not None and self.settings.governor
            else None
        )
        handoff.forget_scheduler_stats()
        if self.settings is not None:
            logger.info(
                "specexpert: token scheduler on (group_size %d, max_wait_steps %d, governor %s)",
                self.settings.group_size,
                self.settings.max_wait_steps,
                "on" if self.governor is not None else "off",
            )

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        self.stats.steps += 1
        self._step_routes, self._next_group = {}, []
        if self.governor is not None:
            self.governor.step_started()
        if self.settings is not None:
            self._hold_back_all_but_one_group()
        ours = time.perf_counter() - started
        output = super().schedule(*args, **kwargs)
        started = time.perf_counter()
        if self.governor is not None:
            self.governor.scheduled(*self._decode_tokens(output))
        self._attach_demand(output)
        ours += time.perf_counter() - started
        self.stats.cpu_s += ours
        self.stats.max_step_cpu_s = max(self.stats.max_step_cpu_s, ours)
        handoff.attach_scheduler_stats(output, asdict(self.stats))
        return output

    def _predicted_routes(self, requests: list) -> torch.Tensor:
        """``[N, L, E]`` bool: each request's predicted next-token experts (once per step)."""
        predictor = self.path_predictor
        shape = predictor.shape
        new = [r for r in requests if r.request_id not in self._step_routes]
        if new:
            windows = predictor.windows_of([r.all_token_ids[-shape.window :] for r in new])
            routes = torch.zeros(len(new), shape.num_layers, shape.num_experts, dtype=torch.bool)
            routes.scatter_(-1, predictor.predict_topk(windows), True)
            self._step_routes.update(zip((r.request_id for r in new), routes, strict=True))
        return torch.stack([self._step_routes[r.request_id] for r in requests])

    def _attach_demand(self, output: Any) -> None:
        """The scheduled decode requests' predicted experts, for the workers."""
        decoding = [
            self.requests[req_id]
            for req_id, n in output.num_scheduled_tokens.items()
            if n == 1 and self.requests[req_id].num_output_tokens > 0
        ]
        if not decoding:
            return
        handoff.attach(
            output,
            StepDemand(
                tokens=len(decoding),
                layers=self._demand_of(decoding),
                next_layers=self._demand_of(self._next_group) if self._next_group else None,
            ),
        )

    def _decode_tokens(self, output: Any) -> tuple[int, bool]:
        """The scheduled requests that decode (a token, or a token and its drafts to
        verify), and whether every scheduled request does."""
        scheduled = output.num_scheduled_tokens
        decoding = sum(
            1
            for req_id, n in scheduled.items()
            if self.requests[req_id].num_output_tokens > 0 and n <= 1 + self.num_spec_tokens
        )
        return decoding, decoding == len(scheduled)

    def _demand_of(self, requests: list) -> dict[int, np.ndarray]:
        """Decoder-layer index -> ``[E]`` predicted tokens per expert of ``requests``."""
        counts = self._predicted_routes(requests).sum(0).numpy()  # [L, E]
        return {index: counts[i] for i, index in enumerate(self.path_predictor.layer_indices)}

    def _decoding(self) -> list:
        """Running requests whose next step is a one-token decode (prompt computed,
        and not held back already by someone else)."""
        step = self.current_step + 1  # schedule() increments it first
        return [
            r
            for r in self.running
            if r.num_output_tokens > 0
            and r.num_tokens - r.num_computed_tokens == 1
            and r.next_decode_eligible_step <= step
        ]

    def _hold_back_all_but_one_group(self) -> None:
        settings = self.settings
        assert settings is not None  # (called under token_scheduler only)
        decoding = self._decoding()
        live = {r.request_id for r in decoding}
        self.waited = {k: v for k, v in self.waited.items() if k in live}
        if len(decoding) <= settings.group_size or (
            self.governor is not None and not self.governor.on(len(decoding))
        ):
            if len(decoding) > settings.group_size:
                self.stats.ungrouped_steps += 1
            for request in decoding:
                self.waited.pop(request.request_id, None)
            return
        self.stats.grouped_steps += 1
        routes = self._predicted_routes(decoding).flatten(1).numpy()
        waited = np.array([self.waited.get(r.request_id, 0) for r in decoding], dtype=np.int64)
        groups = partition(
            routes, settings.group_size, priority=waited, required=waited >= settings.max_wait_steps
        )
        run = np.zeros(len(decoding), dtype=bool)
        run[groups[0]] = True
        if len(groups) > 1:
            self._next_group = [decoding[i] for i in groups[1]]
        self.stats.pairs_run += int(routes[run].any(0).sum())
        self.stats.pairs_all += int(routes.any(0).sum())
        self.stats.pairs_in_order += int(routes[: len(groups[0])].any(0).sum())
        hold_until = self.current_step + 2  # skipped by the coming schedule() only
        for request, runs, wait in zip(decoding, run, waited, strict=True):
            if runs:
                self.waited.pop(request.request_id, None)
                continue
            request.next_decode_eligible_step = max(request.next_decode_eligible_step, hold_until)
            self.waited[request.request_id] = int(wait) + 1
            self.stats.held += 1
            self.stats.max_waited = max(self.stats.max_waited, int(wait) + 1)
