"""SpecExpertConfig: every top-level setting, its default, its range and its docs."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic.dataclasses import dataclass

from vllm_specexpert.config import fit
from vllm_specexpert.config.budget_form import budget_value
from vllm_specexpert.config.errors import (
    ADDITIONAL_CONFIG_KEY,
    SpecExpertConfigError,
    config_error,
)
from vllm_specexpert.config.modes import (
    CACHES,
    MESH_OUTPUT,
    MISS_POLICIES,
    PREDICTORS,
    CacheName,
    CacheSpec,
    MissPolicyName,
    MissPolicySpec,
    Output,
    PredictorName,
    PredictorSpec,
    worse_output,
)
from vllm_specexpert.config.rules import check_combination, check_effect
from vllm_specexpert.config.sections import (
    SETTINGS_READ_AT_START,
    STRICT,
    BuddyConfig,
    Count,
    Directory,
    DiskConfig,
    Flag,
    LinkConfig,
    LookaheadConfig,
    MeshConfig,
    Number,
    Path,
    QualityConfig,
    TokenSchedulerConfig,
    default_of,
)

SECTIONS = {
    "link": LinkConfig,
    "buddy": BuddyConfig,
    "token_scheduler": TokenSchedulerConfig,
    "lookahead": LookaheadConfig,
    "mesh": MeshConfig,
    "quality": QualityConfig,
    "disk": DiskConfig,
}
"""The nested sections, by key."""
"""The largest budget count accepted (no model has more routed experts per layer)."""


@dataclass(config=STRICT)
class SpecExpertConfig:
    """Configuration of the offload-aware MoE layer. Every field has a safe default."""

    budget: float | int | str = "auto"
    """How many routed experts of each MoE layer may be resident on the device (on the
    CPU build: in the RAM slots, the disk tier's cache). ``"auto"`` (default): as many
    as the memory free once the weights are loaded holds, after a KV cache floor, the
    passes' workspace and a 1 GiB reserve (docs/configuration.md: the formula), clamped
    to ``[top_k, experts]``; a start where even ``top_k`` do not fit is refused. A size
    (``"12GiB"``, ``"800MB"``): the tier's bytes over all MoE layers, split evenly across
    them (pooled under ``plec``). A float in (0, 1]: a fraction of the layer's routed
    experts (rounded down). An int >= 2: a count per layer (``1`` reads as 1.0, all
    experts). Every budget leaves room for ``top_k`` experts and is refused at start when
    it does not fit the memory (``allow_budget_beyond_memory``). The start line and
    ``get_stats`` (``budget``) say what was chosen and why.
    Range: (0, 1] as a fraction, [2, 65536] as a count, a positive size, or 'auto'."""

    allow_budget_beyond_memory: Flag = False
    """Start with an explicit ``budget`` larger than what sizing finds free (the OS
    may then kill the process mid-generation). Default ``false``: refused at start."""

    cache: CacheName = "lrfu"
    """Eviction policy of the device cache (default ``lrfu``; ``plec`` under ``lookahead``,
    whose draft predicts each step's demand): ``lrfu`` (the fewest uses, each weighted
    by how recent it is, halving every 2 launches per token of each launch: never more
    bytes than LRU in the benchmarks, ``docs/benchmarks.md``), ``lru`` (least recently
    used), ``lfu`` (least frequently used, ties by recency), ``markov`` (the least
    likely to be used by the next step first, from a chain of each sequence's routes
    counted per layer as it serves, then ``lrfu``'s order) or
    ``static`` (the first ``slots - top_k`` experts stay resident for good; the
    remaining ``top_k`` slots rotate, LRU, for the others): a fixed number of slots per
    layer. ``plec``
    (ExpertFlow's predictive locality-aware cache; needs ``path_predictor``): every
    layer's slots in one pool of the same total size, going to whichever layer the
    predicted demand of the step wants; the step's predicted experts are prefetched
    when it starts (``plec_preload``), and a load evicts first what no prediction needs,
    then from the layer whose turn comes last, then the fewest predicted uses, then
    ``lrfu``'s order (the fewest decayed uses). Exact under ``fetch``."""

    miss_policy: MissPolicyName = "fetch"
    """What a layer does when the router picks a non-resident expert for a decode token
    (prefill tokens always fetch: they run exactly). Exact: ``fetch`` (load it on
    demand over the link, then run it: output identical to vanilla vLLM). Equivalent
    (same experts, summed in another order): ``stream`` (as ``fetch``, but a call whose
    experts do not fit in the slots and the shared region, decode or prefill, reads each
    missing expert once, a token's experts then running in different launches whose
    bf16 results are added in fp32; where ``fetch`` runs whole tokens in groups and reads
    an expert again for each group that needs it. Where the region holds the call, on
    the disk tier of the CPU build, both read each once and run it in one launch:
    exactly), ``cpu`` (compute it on the host from the
    slow tier while the device runs the hits, as llama.cpp/KTransformers do), ``auto``
    (per layer call, the cheaper split of the misses between ``fetch`` and ``cpu`` by
    measured link and host times). Approximate (the output changes): ``speculate``
    (needs a ``predictor``: layers except ``exact_layers`` run the experts and weights
    predicted at the previous layer, speculating-experts §4), ``buddy`` (run a resident
    co-activated buddy instead, behind BuddyMoE's gates, see ``buddy``; fetch when none
    qualifies), ``auto_buddy`` (``buddy`` where the gates allow, ``auto`` for the
    rest), ``random`` (BuddyMoE's baseline: a random resident expert, same gates),
    ``drop`` (run only the resident experts, weights renormalised), ``lowbit`` (HOBBIT:
    run the expert's INT4 copy from ``top_k`` of the layer's slots; bf16 models only,
    the copies are made at load when the engine starts with it)."""

    predictor: PredictorName = "none"
    """How the next layer's experts are predicted, for prefetching (and for
    ``speculate``): ``none`` (no prefetch: on-demand loading only), ``router`` (next
    layer's router on this layer's router input s_l), ``quasi_hidden`` (next router on
    q_l = LN_{l+1}(d_l + r_l) with default vectors d from ``calibration``),
    ``estimator`` (the neural expert estimator of ``estimator`` maps q_l to the next
    layer's router logits, speculating-experts §6), ``hybrid`` (the estimator after the
    layers whose next layer ``quasi_hidden`` predicts worst by ``analysis``,
    ``quasi_hidden`` after the others)."""

    estimator: Directory | None = None
    """Directory written by ``specexpert train-estimator`` for this model and this
    ``calibration``: the neural expert estimator. Required by ``predictor: estimator``
    and ``hybrid``; read and checked against the model and calibration at engine start
    (like ``calibration``, whatever the predictor: ``reconfigure`` can switch to it)."""

    analysis: Directory | None = None
    """Directory written by ``specexpert analyze`` for this model (``analysis.json``):
    ``hybrid`` runs the estimator after the layers whose ``quasi_hidden`` recall there is
    below ``hybrid_threshold``."""

    hybrid_threshold: Annotated[Number, Field(ge=0, le=1)] | None = None
    """``hybrid``: the ``quasi_hidden`` recall@k below which a layer transition uses the
    estimator. ``None`` (default): the mean over the model's transitions. Range: [0, 1]."""

    router_free: Flag = False
    """Under ``speculate``, decode passes skip the router (gate and expert selection) of
    layers whose routing the estimator predicted: they run the prediction anyway. The
    output is the same as without; the prediction's hit rate is then not measured on
    those layers. Needs ``predictor`` ``estimator`` or ``hybrid``, and on the CPU build
    ``enforce_eager`` (compiled mode traces the router into the graph)."""

    plec_preload: Literal["none", "step", "next"] = "none"
    """What ``cache: plec`` loads ahead of demand, beyond choosing victims by the
    predicted uses still to come. ``none`` (default): nothing. ``step``: when a step
    starts, the predicted experts of its later layers, into slots that hold nothing
    predicted. ``next``: that, and under the token scheduler, after each layer the
    predicted experts of the group expected to run next step. Measured on the embedded
    model (``benchmarks/results/batched.json``), preloading raised hit rates but not
    throughput, and under the token scheduler it moved up to 21 % more bytes
    (mispredicted experts), hence the default."""

    prefetch_filter: Literal["cost", "all"] = "cost"
    """Which predicted experts ``fetch`` prefetches. ``cost`` (default): only those
    whose chance of being used (the layer's measured precision per predicted rank)
    pays for their link time, ``p > t_copy / (t_copy + min(t_copy, t_window))``: a
    wrong prefetch occupies the link that the true misses then wait for. ``all``: every
    predicted expert, as in the paper. Under ``speculate`` all predicted experts are
    prefetched either way (they all run)."""
    prefetch_governor: bool = True
    """Prefetch only in the batch sizes where prefetching pays, as measured: per
    batch-size bucket, the wall time per decode token of passes that prefetch and of
    passes that do not (each tried again every 2048 decode tokens); on the disk tier also
    only while a layer's prefetches read no more than none would (judged by bytes from
    the first call: ``planner.bytes_judge``). ``false``: prefetch at every pass. Not
    under ``speculate`` (it runs what it prefetched) or ``prefetch_filter: all``."""

    calibration: Directory | None = None
    """Directory written by ``specexpert calibrate`` for this model (default vectors,
    routing counts, co-activation). Required by ``predictor: quasi_hidden``."""

    path_predictor: Directory | None = None
    """Directory written by ``specexpert train-path`` for this model: the routing-path
    predictor (ExpertFlow §3.2), every MoE layer's experts of a token from its last
    token ids. Checked against the model at engine start. It installs the plugin's
    scheduler class in vLLM (``scheduler_cls``), which predicts the experts of each
    step's decode requests and hands them to the workers: the stats then report the
    predictor's online batch-level accuracy (``path_covered / path_needed``), and
    ``token_scheduler`` groups sequences by them."""

    token_scheduler: TokenSchedulerConfig | None = None
    """Group decode sequences by predicted route, one group per step (see
    :class:`TokenSchedulerConfig`; ``{}`` for its defaults). Needs ``path_predictor``."""

    lookahead: LookaheadConfig | None = None
    """MoE-SpeQ's draft lookahead (see :class:`LookaheadConfig`; ``{}`` for its
    defaults): an INT4 draft of the model drafts up to ``k_max`` tokens per step, its
    routes prefetch the target's experts, vLLM's speculative decoding verifies them.
    ``None`` (default): off."""

    mesh: MeshConfig | None = None
    """Experts across machines on Ray (see :class:`MeshConfig`; ``{}`` for its
    defaults). ``None`` (default): no peers."""

    quality: QualityConfig | None = Field(default_factory=QualityConfig)
    """The quality budget every mode that changes the output runs under, however it was
    reached (at start, by ``reconfigure`` from any mode, after a restart): see
    :class:`QualityConfig`; by default at most 2 % of next-token accuracy lost. Under an
    exact or equivalent mode it waits, unused, for the next approximate one (a setting
    other than the defaults is refused there: it would do nothing now). ``None`` (given):
    no budget, until ``reconfigure`` sets one; warned about at start and at every switch
    into an approximate mode."""

    disk: DiskConfig | None = None
    """The disk tier (see :class:`DiskConfig`; ``{"path": DIR}``). ``None`` (default):
    the experts are held in memory."""

    exact_layers: tuple[Annotated[Count, Field(ge=0)], ...] | None = None
    """Decoder-layer indices that always run their router's experts under
    ``speculate``. ``None`` (default): the first MoE layer only (it has no previous
    layer to predict it anyway). Range: indices of the model's MoE decoder layers."""

    admit_host_experts: Flag = False
    """Under ``cpu``, ``auto``, ``auto_buddy`` and ``lowbit``: after a layer call computed
    missing experts on the host (or from INT4 copies), load the one with the most tokens
    into the cache in the background if the link is idle (evicting by ``cache`` policy),
    so that the cache keeps following the routing as it does under ``fetch``. Off by
    default: on the embedded model it cut host entries by 20-40 % but its effect on
    tok/s stayed within run-to-run noise (-10 % to +5 %,
    ``benchmarks/results/miss_policies.json`` and one earlier run), and it makes the
    host/device split, hence the rounding, depend on timing. Off, the cache keeps its
    warm-start experts under ``cpu`` (static placement, as in llama.cpp/KTransformers)."""

    buddy: BuddyConfig = Field(default_factory=BuddyConfig)
    """Substitution settings of ``buddy``, ``auto_buddy`` and ``random``, see
    :class:`BuddyConfig`."""

    link: LinkConfig = Field(default_factory=LinkConfig)
    """Emulated link (CPU only), see :class:`LinkConfig`."""

    stats_path: Path | None = None
    """If set, per-layer statistics (hits, misses, bytes moved, seconds stalled) are
    written there as JSON by each worker (``{rank}`` in the path is replaced by the
    worker rank), every ``stats_interval_s`` and at every ``specexpert_stats`` call. A
    file is written by renaming a temp file over it: a directory, device node or FIFO
    at the path is refused at start and never replaced."""

    stats_interval_s: Annotated[Number, Field(ge=0, le=86_400)] = 10.0
    """Minimum seconds between two periodic writes of ``stats_path``. Range: [0, 86400] s."""

    @field_validator("budget", mode="before")
    @classmethod
    def _budget(cls, value: Any) -> float | int | str:
        return budget_value(value)

    @field_validator("exact_layers")
    @classmethod
    def _exact_layers(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        return None if value is None else tuple(sorted(set(value)))

    @classmethod
    def from_dict(cls, raw: Any, explicit: set[str] | None = None) -> SpecExpertConfig:
        """Build and validate a config from the user's ``specexpert`` dict.
        ``explicit``: the keys the user set (default: those of ``raw``), which must each
        have an effect under the chosen mode (``reconfigure`` passes its changes only)."""
        if not isinstance(raw, dict):
            raise SpecExpertConfigError(
                ADDITIONAL_CONFIG_KEY,
                f"must be a JSON object, got {type(raw).__name__}",
                'pass e.g. {"specexpert": {"budget": 0.5}} ({} for the defaults)',
            )
        raw = dict(raw)
        for key in ("token_scheduler", "link", "buddy", "lookahead", "mesh", "disk"):
            if key in raw and raw[key] is None:
                del raw[key]  # null: the defaults (the optional sections: off)
        # (``quality: null`` is kept: it turns off a budget that is on by default)
        if "lookahead" in raw and "cache" not in raw:
            # The draft's routes are the step's demand: PLEC plans the pool by it (the
            # default LRU moved 15 % fewer bytes than without a draft, PLEC 60 %).
            raw["cache"] = "plec"
        try:
            config = cls(**raw)
        except ValidationError as error:
            raise config_error(error, cls, SECTIONS) from None
        except TypeError as error:  # a nested object given as something else
            raise SpecExpertConfigError(
                ADDITIONAL_CONFIG_KEY, str(error), "give each section as a JSON object"
            ) from None
        _refuse_huge_ints(raw)  # (what the schema took: its own errors say more)
        check_combination(config)
        check_effect(config, set(raw) if explicit is None else explicit)
        return config

    @property
    def miss_policy_spec(self) -> MissPolicySpec:
        """The traits of ``miss_policy``."""
        return MISS_POLICIES[self.miss_policy]

    @property
    def cache_spec(self) -> CacheSpec:
        return CACHES[self.cache]

    @property
    def predictor_spec(self) -> PredictorSpec:
        return PREDICTORS[self.predictor]

    @property
    def routing_statistics_need(self) -> str | None:
        """Why the miss policy needs the calibration's routing statistics: co-activation
        counts (buddy lists) or TAE percentiles (a percentile tau); ``None``: it does not."""
        policy = self.miss_policy_spec
        if policy.uses_buddy_lists:
            return "buddy lists come from its co-activation counts"
        if policy.substitutes and self.buddy.tau is None:
            return "the TAE gate's tau comes from its percentiles (buddy.tau_percentile)"
        return None

    @property
    def output(self) -> Output:
        """``exact``, ``equivalent`` or ``approximate``: the miss policy's ``output``,
        or the mesh's when that changes more (peers' results are summed apart from the
        device's: at best equivalent; ``no_stop`` is approximate)."""
        return worse_output(
            self.miss_policy_spec.output, None if self.mesh is None else MESH_OUTPUT[self.mesh.mode]
        )

    @property
    def loads_through_region(self) -> bool:
        """Whether the miss policy loads every missing expert on the device (``fetch``,
        ``stream``) with no mode that places experts elsewhere or keeps rows after the
        slots (``mesh``'s peers, the ``lookahead`` draft's rows): then a layer's slots on
        the CPU build's disk tier may be split into its own and a shared region's."""
        policy = self.miss_policy_spec
        return (
            (policy.name == "fetch" or policy.splits_tokens)
            and self.mesh is None
            and self.lookahead is None
        )

    @property
    def exact(self) -> bool:
        """Whether outputs are bit-identical to vanilla vLLM."""
        return self.output == "exact"

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> SpecExpertConfig | None:
        """The config inside vLLM's ``additional_config``, or ``None`` when the
        ``specexpert`` key is absent (the plugin then stays inert)."""
        if not isinstance(additional_config, dict):
            return None
        if ADDITIONAL_CONFIG_KEY not in additional_config:
            return None
        return cls.from_dict(additional_config[ADDITIONAL_CONFIG_KEY])

    @property
    def unbudgeted(self) -> str | None:
        """Why the output is approximate with no quality budget holding it (``None``:
        exact, equivalent or budgeted): the start and ``reconfigure`` warn with it."""
        if self.output != "approximate" or self.quality is not None:
            return None
        mode = (
            f"mesh mode '{self.mesh.mode}'"
            if self.mesh is not None and self.miss_policy_spec.output != "approximate"
            else f"miss_policy '{self.miss_policy}'"
        )
        return (
            f"{mode} changes the output and runs without a quality budget (quality is "
            "null): "
            "nothing holds it to 98 % of exact accuracy (without one the embedded model "
            "kept 0.970 under speculate, 0.927 under mesh no_stop; docs/benchmarks.md)"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def check_changes(cls, changes: dict[str, Any]) -> None:
        """Each of ``reconfigure``'s ``changes`` checked alone, in the caller: a value out
        of its field's range, or one that cannot be sent to the workers (an integer past
        64 bits), is refused before it is sent. What depends on the other settings is
        checked by the workers (:meth:`changed`)."""
        names = {f.name for f in dataclasses.fields(cls)}
        _refuse_huge_ints(changes)
        for key, value in changes.items():
            if key not in names:
                continue  # (the workers name an unknown key, with the closest known one)
            try:
                cls(**{key: value})
            except ValidationError as error:
                refused = [i for i, e in enumerate(error.errors()) if _refused_alone(e, key)]
                if refused:
                    raise config_error(error, cls, SECTIONS, refused[0]) from None
            except TypeError:
                pass  # (a section given as something else: the workers say so)

    def changed(self, changes: dict[str, Any]) -> SpecExpertConfig:
        """This config with ``changes`` (``reconfigure``): the changed keys must have an
        effect; a section given (``link``, ``buddy``) replaces the current one, but for
        its settings read at start, which it keeps unless it names them
        (``lookahead={"k": 2}`` keeps ``k_max``: :data:`SETTINGS_READ_AT_START`). A setting
        kept from before that has no effect any more under the changed mode (say
        ``plec_preload`` after ``cache: lru``) goes back to its default, so that the
        result is a config that would also pass at engine start."""
        if not isinstance(changes, dict):
            raise SpecExpertConfigError(
                ADDITIONAL_CONFIG_KEY,
                "changes must be keyword arguments",
                "e.g. reconfigure(llm, budget=0.25)",
            )
        current = self.to_dict()
        merged = {**current, **changes}
        for section, names in SETTINGS_READ_AT_START.items():
            change, running = changes.get(section), current.get(section)
            if isinstance(change, dict) and isinstance(running, dict):
                merged[section] = {**{n: running[n] for n in names}, **change}
        for _ in range(len(merged) + 1):
            config = self.from_dict(merged, explicit=set(changes))
            try:
                check_effect(config, set(merged))
                return config
            except SpecExpertConfigError as error:
                section, _, name = error.field_name.partition(".")
                if section in changes:
                    raise
                if name:
                    merged[section] = {**merged[section], name: default_of(SECTIONS[section], name)}
                else:
                    merged[section] = default_of(SpecExpertConfig, section)
        raise AssertionError("unreachable: every reset removes one setting")

    def draft_config(self, top_k: int, slots: int | None = None) -> SpecExpertConfig:
        """The config of the ``lookahead`` draft's own engine: its INT4 experts loaded
        into ``lookahead.draft_budget`` of slots on demand (decoded to bf16, or INT4 as
        they are), exactly (no link emulation: a load is device work, not a
        transfer). ``slots``: the count per layer when ``draft_budget`` is unset, where
        the caller sizes it (the disk tier's packed draft: its slots are its cache).
        Only with ``lookahead``."""
        if self.lookahead is None:
            raise ValueError("draft_config: this config has no lookahead (no draft)")
        budget: float | int | None = self.lookahead.draft_budget
        if budget is None and slots is not None:
            # The target's plan counted them (each of its slots brought one): not
            # checked against what is free after it.
            return SpecExpertConfig(budget=slots, allow_budget_beyond_memory=True, quality=None)
        if budget is None:  # (under disk: the fewest slots that run a token, ``top_k``)
            budget = top_k if self.disk is not None else 1.0
        # (quality null: the draft's tokens are verified, never served; no tap in its graph)
        return SpecExpertConfig(budget=budget, quality=None)

    def draft_cache_rows(self, num_experts: int, top_k: int, slots: int) -> int:
        """Under ``disk``, the ``lookahead`` draft's INT4 experts held in memory per
        layer (``lookahead.draft_cache``: ``auto``, the target's ``slots`` per layer; at
        least one token's)."""
        assert self.lookahead is not None  # (only a config with a draft asks)
        share = self.lookahead.draft_cache
        rows = slots if share == "auto" else math.floor(share * num_experts + 1e-9)
        return max(top_k, rows)

    @property
    def draft_rows_follow_slots(self) -> bool:
        """The ``lookahead`` draft's INT4 rows are sized with the slots, one per slot
        (``draft_cache: "auto"`` on the disk tier)."""
        return (
            self.lookahead is not None
            and self.disk is not None
            and self.lookahead.draft_cache == "auto"
        )

    @property
    def read_ahead_rows(self) -> int | Literal["auto"]:
        """``disk.read_ahead_rows``; ``"auto"`` without a ``disk`` section (a disk tier the
        caller added runs at the defaults)."""
        return self.disk.read_ahead_rows if self.disk is not None else "auto"

    @property
    def lends_draft_rows(self) -> bool:
        """The ``lookahead`` draft's rows, sized with the slots under ``budget: "auto"``,
        are the target's slots until the governor first drafts: it starts at k = 0
        (``lookahead.k`` unset, ``explore_after_tokens`` above 0), and a draft that does
        not draft reads none of its experts."""
        return (
            self.draft_rows_follow_slots
            and self.budget == "auto"
            and self.lookahead is not None
            and self.lookahead.draft_budget is None
            and self.lookahead.k is None
            and self.lookahead.explore_after_tokens > 0
        )

    # ------------------------------------------------------- model-dependent checks

    def check_fits(self, num_experts: int, top_k: int, packed: str | None = None) -> int | None:
        """The slots per MoE layer once every setting that depends on the model is
        checked (:func:`~vllm_specexpert.config.fit.check_fits`); ``None`` for a budget
        not sized yet."""
        return fit.check_fits(self, num_experts, top_k, packed)

    def slots_per_layer(self, num_experts: int, top_k: int) -> int:
        """Device cache slots per MoE layer for ``num_experts`` routed experts per layer
        and ``top_k`` per token (:func:`~vllm_specexpert.config.fit.slots_per_layer`)."""
        return fit.slots_per_layer(self, num_experts, top_k)

    @property
    def budget_sized(self) -> bool:
        """Whether ``budget`` gives the slots by itself (a fraction or a count), not
        from the model's bytes or the memory (a size, ``auto``)."""
        return not isinstance(self.budget, str)


def _refused_alone(error: Any, key: str) -> bool:
    """Whether pydantic's ``error`` of ``{key: value}`` alone refuses ``reconfigure``'s
    change of ``key``: not a setting read at start left out of the section (the running
    one is kept, :meth:`SpecExpertConfig.changed`: ``disk={"read_ahead_rows": 8}``)."""
    loc = error["loc"]
    kept = SETTINGS_READ_AT_START.get(key, ())
    left_out = error["type"] == "missing" and len(loc) > 1 and loc[1] in kept
    return loc[:1] == (key,) and not left_out


def _refuse_huge_ints(raw: dict[str, Any]) -> None:
    """Refuse an integer past 64 bits anywhere in ``raw``, naming its field: the RPC of
    ``reconfigure`` cannot carry one to the workers (msgpack), and a value refused there
    is refused at start too (one set of checks for both)."""
    for key, value in raw.items():
        where = _huge_int_at(value)
        if where is not None:
            raise SpecExpertConfigError(
                ".".join([str(key), *where]),
                "holds an integer past 64 bits",
                "give a value in the field's range",
            )


def _huge_int_at(value: Any) -> list[str] | None:
    """The path to an integer past 64 bits in ``value`` (``[]``: ``value`` is one;
    ``None``: there is none)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return None if -(2**63) <= value < 2**64 else []
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, (list, tuple))
        else ()
    )
    for key, item in items:
        where = _huge_int_at(item)
        if where is not None:
            return [] if isinstance(value, (list, tuple)) else [str(key), *where]
    return None
