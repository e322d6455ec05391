"""What a config's ``budget`` comes to, in slots per MoE layer, and why.

A size or ``auto`` is sized from the memory free when the weights are loaded and no slot
is made yet (the first MoE layer), and again at every ``reconfigure``, within the start's
memory plan (:func:`~vllm_specexpert.config.sizing.fit_budget`); a fraction or a count is
checked against the same memory. The user's config is kept as given: the plan is
carried beside it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.config.fit import budget_slots
from vllm_specexpert.config.sizing import BudgetFit, SizingSettings, fit_budget
from vllm_specexpert.tiers.memory import memory_report
from vllm_specexpert.tiers.store import ExpertSource


@dataclass(frozen=True)
class SlotPlan:
    """The slots per MoE layer of one config: ``fit``'s where it was sized, else the
    config's fraction or count of each layer's experts (an engine built without vLLM,
    whose MoE layers are not counted); ``lent`` more while the ``lookahead`` draft's rows
    are lent to them (:attr:`SpecExpertConfig.lends_draft_rows`)."""

    budget: float | int | str
    fit: BudgetFit | None = None
    lent: int = 0
    """Slots per layer made of the draft's rows' bytes until it first drafts."""

    def slots(self, num_experts: int, top_k: int) -> int:
        if self.fit is not None:
            return self.fit.slots_per_layer + self.lent
        if isinstance(self.budget, str):
            raise RuntimeError(f"budget {self.budget!r} is not sized (no MoE layer counted)")
        return budget_slots(self.budget, num_experts, top_k) + self.lent

    def drafting(self) -> SlotPlan:
        """The plan once the draft holds its rows (nothing lent)."""
        return replace(self, lent=0)


class BudgetPlan:
    """Sizes budgets for one engine: the memory report, vLLM's settings
    (:attr:`sizing`, filled by the adapter) and the start's memory plan."""

    def __init__(self, device: torch.device, field: str = "budget") -> None:
        self.device = device
        self.field = field
        """The user's setting the budget comes from, which its errors name (an engine
        the adapter builds from another setting is given that one)."""
        self.sizing = SizingSettings()
        self.current: SlotPlan | None = None
        """The running config's plan, once the first MoE layer is added."""
        self._start_parts: dict[str, float] | None = None
        self.rows_lent = False
        """The ``lookahead`` draft's rows are not made yet, their bytes lent to the slots
        (:attr:`SpecExpertConfig.lends_draft_rows`, from the start's plan until
        :meth:`draft_rows_made`)."""

    @property
    def fit(self) -> BudgetFit | None:
        return self.current.fit if self.current is not None else None

    def plan(
        self, config: SpecExpertConfig, experts: ExpertSource, top_k: int, freed_bytes: int = 0
    ) -> SlotPlan:
        """``config``'s plan for a model whose MoE layers hold ``experts``' kind, checked
        against the memory free now. ``freed_bytes``: the slots a rebuild frees first (a
        rebuild is sized within the start's plan); 0 at start. Not adopted."""
        if config.budget_sized and self.sizing.moe_layers == 0:
            return SlotPlan(config.budget)
        shapes = self.sizing.shapes(
            experts.num_experts, top_k, experts.slot_nbytes, experts.staging_nbytes
        )
        rebuild = self.current is not None
        memory = memory_report(self.device, self.sizing, freed_bytes)
        # The draft's rows are lent from the start until it drafts; a rebuild meanwhile
        # counts them still (they are made when it drafts).
        unheld = shapes.draft_row_bytes > 0 and (
            config.lends_draft_rows if self.current is None else self.rows_lent
        )
        try:
            fit = fit_budget(
                config.budget,
                shapes,
                memory,
                config.allow_budget_beyond_memory,
                self._start_parts if rebuild else None,
                rows_unheld=unheld,
            )
        except SpecExpertConfigError as error:
            if self.field == "budget":
                raise
            raise SpecExpertConfigError(
                self.field, error.problem, f"a smaller {self.field}"
            ) from None
        lent = 0
        if unheld and config.budget == "auto":  # (the rows' bytes, as this layer's slots)
            lent = min(
                shapes.num_experts - fit.slots_per_layer,
                fit.slots_per_layer
                * shapes.draft_row_bytes
                // (shapes.moe_layers * shapes.expert_bytes),
            )
        return SlotPlan(config.budget, fit, lent)

    def adopt(self, plan: SlotPlan) -> None:
        """``plan`` is the running config's (the first adopted is the start's)."""
        if self.current is None:
            self._start_parts = plan.fit.parts if plan.fit is not None else None
            self.rows_lent = plan.lent > 0
        self.current = plan

    def draft_rows_made(self) -> None:
        """The draft makes its rows now: later plans count them as held."""
        self.rows_lent = False


def size_host_cache(
    config: SpecExpertConfig, sizing: SizingSettings, experts: ExpertSource, top_k: int
) -> BudgetFit:
    """``disk.host_cache`` (CUDA: pinned host rows between the disk and the device) in
    experts per MoE layer, by :func:`fit_budget` on the host's free memory, with no KV
    cache or pass workspace there (both are on the GPU), around the ``lookahead``
    draft's INT4 experts (built later, in host memory); unset is ``auto``."""
    assert config.disk is not None
    plan = BudgetPlan(torch.device("cpu"), "disk.host_cache")
    plan.sizing = SizingSettings(
        moe_layers=sizing.moe_layers,
        moe_intermediate_size=sizing.moe_intermediate_size,
        kv_cache_bytes=0,
        draft_int4_bytes=sizing.draft_host_bytes,
    )
    setting = config.disk.host_cache if config.disk.host_cache is not None else "auto"
    host = SpecExpertConfig(
        budget=setting, allow_budget_beyond_memory=config.allow_budget_beyond_memory
    )
    fit = plan.plan(host, experts, top_k).fit
    assert fit is not None  # (the MoE layers are counted: every budget is sized)
    return fit


class PoolUser(Protocol):
    """What the reach check reads of a layer (an ``OffloadedLayer``)."""

    @property
    def experts(self) -> ExpertSource: ...
    @property
    def top_k(self) -> int: ...
    @property
    def pool_reach(self) -> int | None: ...


def check_pool_reach(plan: SlotPlan, layers: Iterable[PoolUser]) -> None:
    """Raise a config error when a slot pool made of ``layers`` under ``plan`` is a tensor
    larger than their kernel can address (their ``pool_reach``): one layer's slots, the
    least any pool holds (a shared-pool ``cache``, ``plec``, splits its pool into runs of
    layers within the reach: :class:`~vllm_specexpert.tiers.slots.SharedPools`)."""
    layers = [la for la in layers if la.pool_reach is not None]
    if not layers:
        return
    limit = min(la.pool_reach for la in layers if la.pool_reach is not None)
    widest = max(math.prod(shape) for la in layers for shape, _ in la.experts.slot_shapes.values())
    why = f"and the expert kernel addresses at most 2^{(limit + 1).bit_length() - 1}"
    mapped = [la for la in layers if la.experts.in_place]
    if mapped and max(la.experts.num_experts for la in mapped) * widest > limit:
        experts = max(la.experts.num_experts for la in mapped)
        raise SpecExpertConfigError(
            "disk.residency",
            f"'mapped' runs the kernel on each layer's {experts} experts in the pack, "
            f"{experts * widest:,} elements per tensor, {why}",
            "use disk.residency 'slots'",
        )
    slots = [
        plan.slots(la.experts.num_experts, la.top_k) for la in layers if not la.experts.in_place
    ]
    if not slots:
        return
    pooled = max(slots)
    if pooled * widest <= limit:
        return
    reach = limit // widest
    raise SpecExpertConfigError(
        "budget",
        f"{pooled} slots per layer make a pool of {pooled * widest / 1e9:.2f} G elements "
        f"per tensor, {why}",
        f"a budget of at most {reach} slots per layer",
    )
