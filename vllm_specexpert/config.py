"""SpecExpertConfig: every knob of the plugin, its default, its range, and its validation.

Users set it through vLLM's ``additional_config={"specexpert": {...}}`` (CLI:
``--additional-config '{"specexpert": {...}}'``). The classes are pydantic dataclasses
(vLLM's config idiom): types, ranges (in each field's docstring), finiteness and unknown
keys are checked by pydantic when :meth:`SpecExpertConfig.from_dict` builds one at engine
start. On top of that, two rules:

- **A setting must do something under the chosen mode.** A key the user sets that only
  tunes a mode which is off (``buddy`` under ``fetch``, ``link.latency_us`` without an
  emulated link, ``exact_layers`` without ``speculate``, ...) is an error naming what it
  needs. Artifacts (``calibration``, ``path_predictor``) are exempt: they are loaded and
  checked whatever the mode, and ``reconfigure`` may switch to a mode that uses them.
- **What depends on the model** (the budget against top_k and the experts per layer,
  ``exact_layers`` against the MoE layers, artifacts against the model's shapes) is
  checked when the engine knows the model, still before serving.

Every error is a :class:`SpecExpertConfigError` that names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, Strict, ValidationError, field_validator
from pydantic.dataclasses import dataclass

ADDITIONAL_CONFIG_KEY = "specexpert"

CACHE_POLICIES = ("lru", "lfu", "static", "plec")
PREDICTORS = ("none", "router", "quasi_hidden")
PREFETCH_FILTERS = ("cost", "all")
PLEC_PRELOADS = ("none", "step", "next")

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True,
                     frozen=True)
"""Unknown keys, NaN and infinities are errors; docstrings are the fields' docs."""

Number = Annotated[float, Strict()]
"""A JSON number (an int is accepted; a bool or a string is not)."""
Count = Annotated[int, Strict()]
Flag = Annotated[bool, Strict()]
Path = Annotated[str, Strict(), Field(min_length=1)]


class SpecExpertConfigError(ValueError):
    """A bad ``specexpert`` setting. The message names the field and how to fix it."""

    def __init__(self, field_name: str, problem: str, fix: str):
        self.field_name, self.problem, self.fix = field_name, problem, fix
        super().__init__(f"specexpert config: field '{field_name}': {problem}. Fix: {fix}")


@dataclass(config=_STRICT)
class LinkConfig:
    """The emulated link between the slow tier and the device cache.

    On CUDA the real copy engine is used and these fields must be unset. On CPU, every
    expert copy is really performed, and when ``bandwidth_gbps`` is set the copy becomes
    usable only ``latency_us + bytes / bandwidth`` after the link is free, copies being
    serialized like one copy engine. This lets a CPU run reproduce a GPU box's ratio of
    copy time to compute time.
    """

    bandwidth_gbps: Annotated[Number, Field(ge=0.0001, le=10_000)] | None = None
    """Emulated bandwidth in gigabytes per second (1e9 bytes/s, not gigabits).
    PCIe 4.0 x16 moves about 25 GB/s host-to-device in practice; PCIe 3.0 x16 about 12.
    ``None`` (default): no emulation, copies take what the memcpy takes.
    Range: [0.0001, 10000] GB/s (the low end is for tiny test models)."""

    latency_us: Annotated[Number, Field(ge=0, le=1_000_000)] = 0.0
    """Fixed emulated cost in microseconds of each copy (launch + DMA setup); an expert
    is one copy per weight tensor (2 for ``w13`` + ``w2``). Only used when
    ``bandwidth_gbps`` is set. Range: [0, 1e6] us."""

    host_slowdown: Annotated[Number, Field(ge=1, le=1000)] = 14.0
    """Emulated speed of the host for the ``cpu`` and ``auto`` miss policies: an expert
    computed on the host from the slow tier counts as ready only ``host_slowdown`` times
    its measured time on this processor after it started (the device ran the hits
    meanwhile). Default 14: decode-time expert compute is memory-bound, and an
    RTX-4090-class GPU (~1000 GB/s) reads weights about 14x faster than a dual-channel
    DDR5 desktop CPU (~70 GB/s) (an estimate). Only used when ``bandwidth_gbps`` is set;
    without emulation the host compute takes what it takes. Range: [1, 1000]."""

    @property
    def emulated(self) -> bool:
        return self.bandwidth_gbps is not None


@dataclass(config=_STRICT)
class TokenSchedulerConfig:
    """The token scheduler (ExpertFlow §3.3; ``token_scheduler: {}`` for these defaults).
    When more decode sequences are runnable than ``group_size``, each step runs one group
    of them whose predicted routes (``path_predictor``) overlap most; the others keep
    their KV blocks and wait. Prefill is never held back."""

    group_size: Annotated[Count, Field(ge=1, le=4096)] = 8
    """Decode sequences run per step when more are runnable. Range: [1, 4096]."""
    max_wait_steps: Annotated[Count, Field(ge=0, le=1000)] = 4
    """Consecutive steps a runnable decode sequence may be held back: once it has waited
    this long it runs in the next step's group, whatever its route. Range: [0, 1000]."""


@dataclass(config=_STRICT)
class BuddyConfig:
    """BuddyMoE's substitution settings (``buddy``, ``auto_buddy`` and ``random`` miss
    policies; ``../shared/papers/buddymoe.txt`` §3). Defaults: the paper's best setting
    (α = 0.95, |B| <= 16, ρ = 3) and a TAE gate at the 15th percentile (its 10-20 range)."""

    alpha: Annotated[Number, Field(gt=0, le=1)] = 0.95
    """Cumulative Frequency Threshold of the buddy lists, in (0, 1]: an expert's buddies are
    its most co-activated peers until their share of its co-activations reaches alpha.
    Range: (0, 1]."""

    k_max: Annotated[Count, Field(ge=1, le=65536)] = 16
    """Longest buddy list per expert. Range: [1, 65536]."""

    tau: Annotated[Number, Field(ge=0, le=1)] | None = None
    """Token Activating Entropy gate in [0, 1]: a token whose normalised routing entropy
    is <= tau keeps its experts (fetch). ``None`` (default): per layer, the
    ``tau_percentile``-th percentile of the calibration's TAE distribution. Range: [0, 1]."""

    tau_percentile: Annotated[Number, Field(ge=0, le=100)] = 15.0
    """Percentile (0-100) of each layer's calibrated TAE used as tau when ``tau`` is
    unset: about this share of tokens is never substituted. Range: [0, 100]."""

    beta: Annotated[Number, Field(gt=0, le=1)] = 0.75
    """Batch distribution gate in (0, 1]: no substitution in a layer call where this share
    or more of the distinct requested experts is missing (broad substitution compounds
    errors; the paper leaves the value to the deployment, this default is ours). Range: (0, 1]."""

    rho: Annotated[Count, Field(ge=1, le=65536)] = 3
    """Replacement budget: at most this many substituted experts per token. Range: [1, 65536]."""


@dataclass(config=_STRICT)
class SpecExpertConfig:
    """Configuration of the offload-aware MoE layer. Every field has a safe default."""

    budget: float | int = 0.5
    """How many routed experts of each MoE layer may be resident on the device.
    A float in (0, 1] is a fraction of the layer's routed experts (rounded down);
    an int >= 2 is a count per layer (``1`` reads as 1.0, all experts). Must leave room
    for at least ``top_k`` experts (one token's experts) and cannot exceed the number of
    experts. 1.0 keeps every expert resident (no transfers after warm-up).
    Range: (0, 1] as a fraction, [2, 65536] as a count."""

    cache: Literal["lru", "lfu", "static", "plec"] = "lru"
    """Eviction policy of the device cache: ``lru`` (least recently used), ``lfu``
    (least frequently used, ties by recency) or ``static`` (the first
    ``slots - top_k`` experts stay resident for good; the remaining ``top_k`` slots
    rotate, LRU, for the others): a fixed number of slots per layer. ``plec``
    (ExpertFlow's predictive locality-aware cache; needs ``path_predictor``): every
    layer's slots in one pool of the same total size, going to whichever layer the
    predicted demand of the step wants; the step's predicted experts are prefetched
    when it starts (``plec_preload``), and a load evicts first what no prediction needs,
    then from the layer whose turn comes last, then the fewest predicted uses, then the
    least recently used. Exact under ``fetch``."""

    miss_policy: Annotated[str, Strict()] = "fetch"
    """What a layer does when the router picks a non-resident expert for a decode token
    (prefill tokens always fetch: they run exactly). Exact: ``fetch`` (load it on
    demand over the link, then run it: output identical to vanilla vLLM). Equivalent
    (same experts, summed in another order): ``cpu`` (compute it on the host from the
    slow tier while the device runs the hits, as llama.cpp/KTransformers do), ``auto``
    (per layer call, the cheaper split of the misses between ``fetch`` and ``cpu`` by
    measured link and host times). Approximate (the output changes): ``speculate``
    (needs a ``predictor``: layers except ``exact_layers`` run the experts and weights
    predicted at the previous layer, speculating-experts §4), ``buddy`` (run a resident
    co-activated buddy instead, behind BuddyMoE's gates, see ``buddy``; fetch when none
    qualifies), ``auto_buddy`` (``buddy`` where the gates allow, ``auto`` for the
    rest), ``random`` (BuddyMoE's baseline: a random resident expert, same gates),
    ``drop`` (run only the resident experts, weights renormalised)."""

    predictor: Literal["none", "router", "quasi_hidden"] = "none"
    """How the next layer's experts are predicted, for prefetching (and for
    ``speculate``): ``none`` (no prefetch: on-demand loading only), ``router`` (next
    layer's router on this layer's router input s_l), ``quasi_hidden`` (next router on
    q_l = LN_{l+1}(d_l + r_l) with default vectors d from ``calibration``)."""

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

    calibration: Path | None = None
    """Directory written by ``specexpert calibrate`` for this model (default vectors,
    routing counts, co-activation). Required by ``predictor: quasi_hidden``."""

    path_predictor: Path | None = None
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

    exact_layers: tuple[Annotated[Count, Field(ge=0)], ...] | None = None
    """Decoder-layer indices that always run their router's experts under
    ``speculate``. ``None`` (default): the first MoE layer only (it has no previous
    layer to predict it anyway). Range: indices of the model's MoE decoder layers."""

    admit_host_experts: Flag = False
    """Under ``cpu``, ``auto`` and ``auto_buddy``: after a layer call computed missing
    experts on the host, load the one with the most tokens into the cache in the
    background if the link is idle (evicting by ``cache`` policy), so that the cache keeps
    following the routing as it does under ``fetch``. Off by default: on the embedded
    model it cut host entries by 20-40 % but its effect on tok/s stayed within run-to-run
    noise (-10 % to +5 %, ``benchmarks/results/miss_policies.json`` and one earlier run),
    and it makes the host/device split, hence the rounding, depend on timing. Off, the
    cache keeps its warm-start experts under ``cpu`` (static placement, as in
    llama.cpp/KTransformers)."""

    buddy: BuddyConfig = Field(default_factory=BuddyConfig)
    """Substitution settings of ``buddy``, ``auto_buddy`` and ``random``, see
    :class:`BuddyConfig`."""

    link: LinkConfig = Field(default_factory=LinkConfig)
    """Emulated link (CPU only), see :class:`LinkConfig`."""

    stats_path: Path | None = None
    """If set, per-layer statistics (hits, misses, bytes moved, seconds stalled) are
    written there as JSON by each worker (``{rank}`` in the path is replaced by the
    worker rank), every ``stats_interval_s`` and at every ``specexpert_stats`` call."""

    stats_interval_s: Annotated[Number, Field(ge=0, le=86_400)] = 10.0
    """Minimum seconds between two periodic writes of ``stats_path``. Range: [0, 86400] s."""

    @field_validator("budget", mode="before")
    @classmethod
    def _budget(cls, value: Any) -> float | int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"must be finite, got {value}")
        if isinstance(value, float) and value.is_integer() and value > 1:
            value = int(value)
        if isinstance(value, int):
            if value == 1:
                # JSON cannot tell 1 from 1.0: read it as the fraction (all experts resident).
                return 1.0
            if not 2 <= value <= MAX_EXPERTS:
                raise ValueError(f"count must be in [2, {MAX_EXPERTS}], got {value:.6g}")
            return value
        if not 0.0 < value <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {value:.6g}")
        return float(value)

    @field_validator("miss_policy")
    @classmethod
    def _miss_policy(cls, value: str) -> str:
        choices = tuple(_miss_policy_classes())
        if value not in choices:
            raise ValueError(f"unsupported value {value!r}; use one of {', '.join(choices)}")
        return value

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
                ADDITIONAL_CONFIG_KEY, f"must be a JSON object, got {type(raw).__name__}",
                'pass e.g. {"specexpert": {"budget": 0.5}} ({} for the defaults)')
        raw = dict(raw)
        for key in ("token_scheduler", "link", "buddy"):
            if key in raw and raw[key] is None:
                del raw[key]  # null: the defaults (token_scheduler: off)
        try:
            config = cls(**raw)
        except ValidationError as error:
            raise _config_error(error, cls) from None
        except TypeError as error:  # a nested object given as something else
            raise SpecExpertConfigError(ADDITIONAL_CONFIG_KEY, str(error),
                                        "give each section as a JSON object") from None
        config._check_combination()
        config._check_effect(raw, set(raw) if explicit is None else explicit)
        return config

    def _check_combination(self) -> None:
        policy = self.miss_policy_class
        if policy.needs_predictor and self.predictor == "none":
            raise SpecExpertConfigError(
                "miss_policy", f"'{policy.name}' runs predicted experts, but 'predictor' is 'none'",
                'set "predictor": "router" or "quasi_hidden"',
            )
        why = policy.calibration_need(self)
        if why is not None and self.calibration is None:
            raise SpecExpertConfigError(
                "calibration", f"miss_policy '{self.miss_policy}' needs a calibration: {why}",
                "run `specexpert calibrate MODEL --out DIR` and set \"calibration\": \"DIR\"",
            )
        if self.predictor == "quasi_hidden" and self.calibration is None:
            raise SpecExpertConfigError(
                "calibration", "predictor 'quasi_hidden' needs default vectors, and none is set",
                "run `specexpert calibrate MODEL --out DIR` and set \"calibration\": \"DIR\"",
            )
        if self.cache == "plec" and self.path_predictor is None:
            raise SpecExpertConfigError(
                "cache", "'plec' allocates slots by the predicted demand of each step, and "
                "no path predictor is set",
                "set \"path_predictor\": \"DIR\" (from `specexpert train-path MODEL --out "
                "DIR`), or use cache 'lru'")
        if self.token_scheduler is not None and self.path_predictor is None:
            raise SpecExpertConfigError(
                "path_predictor", "token_scheduler groups sequences by predicted route, and no "
                "path predictor is set",
                "run `specexpert train-path MODEL --out DIR` and set \"path_predictor\": \"DIR\"")

    def _check_effect(self, raw: dict, explicit: set[str]) -> None:
        """A setting the user gave a value other than its default must do something
        under the chosen mode."""
        policy = self.miss_policy_class
        defaults = {"link": LinkConfig(), "buddy": BuddyConfig()}

        def given(key: str) -> bool:
            section, _, name = key.partition(".")
            if section not in explicit:
                return False
            if section in defaults:
                mine, default = getattr(self, section), defaults[section]
                names = [name] if name else [f.name for f in dataclasses.fields(mine)]
                return any(getattr(mine, n) != getattr(default, n) for n in names)
            return getattr(self, key) != _default_of(key)

        def needs(key: str, what: str, fix: str) -> None:
            if given(key):
                raise SpecExpertConfigError(key, f"has no effect {what}", fix)

        if not self.link.emulated:
            for key in ("link.latency_us", "link.host_slowdown"):
                needs(key, "without an emulated link (link.bandwidth_gbps is unset)",
                      "set link.bandwidth_gbps too, or remove it")
        if not policy.computes_on_host:
            needs("admit_host_experts", f"under miss_policy '{self.miss_policy}' (it admits "
                  "experts computed on the host)", "use miss_policy cpu, auto or auto_buddy, "
                  "or remove it")
        if not policy.substitutes:
            needs("buddy", f"under miss_policy '{self.miss_policy}' (it tunes substitution)",
                  "use miss_policy buddy, auto_buddy or random, or remove it")
        if given("buddy.tau") and given("buddy.tau_percentile") and self.buddy.tau is not None:
            raise SpecExpertConfigError(
                "buddy.tau_percentile", "has no effect when buddy.tau is set (the percentile "
                "only chooses tau when it is unset)", "remove one of the two")
        if not policy.speculates:
            needs("exact_layers", f"under miss_policy '{self.miss_policy}' (only speculate "
                  "runs predicted experts)", "use miss_policy speculate, or remove it")
        if self.predictor == "none":
            needs("prefetch_filter", "with predictor 'none' (nothing is prefetched)",
                  "set predictor 'router' or 'quasi_hidden', or remove it")
        if self.cache != "plec":
            needs("plec_preload", f"with cache '{self.cache}'", "use cache 'plec', or remove it")
        if self.stats_path is None:
            needs("stats_interval_s", "without stats_path", "set stats_path, or remove it")

    @property
    def miss_policy_class(self):
        """The class of ``miss_policy``: the one source of its traits."""
        return _miss_policy_classes()[self.miss_policy]

    @property
    def needs_routing_statistics(self) -> bool:
        """Whether the miss policy needs the calibration's co-activation counts (buddy
        lists) or TAE percentiles (a percentile tau)."""
        return self.miss_policy_class.calibration_need(self) is not None

    @property
    def output(self) -> str:
        """``exact``, ``equivalent`` or ``approximate``: the miss policy's ``output``."""
        return self.miss_policy_class.output

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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def changed(self, changes: dict[str, Any]) -> SpecExpertConfig:
        """This config with ``changes`` (``reconfigure``): the changed keys must have an
        effect; a section given (``link``, ``buddy``) replaces the current one. A setting
        kept from before that has no effect any more under the changed mode (say
        ``plec_preload`` after ``cache: lru``) goes back to its default, so that the
        result is a config that would also pass at engine start."""
        if not isinstance(changes, dict):
            raise SpecExpertConfigError(ADDITIONAL_CONFIG_KEY, "changes must be keyword "
                                        "arguments", "e.g. reconfigure(llm, budget=0.25)")
        merged = {**self.to_dict(), **changes}
        for _ in range(len(merged) + 1):
            config = self.from_dict(merged, explicit=set(changes))
            try:
                config._check_effect(merged, set(merged))
                return config
            except SpecExpertConfigError as error:
                section, _, name = error.field_name.partition(".")
                if section in changes:
                    raise
                if name:
                    merged[section] = {**merged[section], name: _default_of(name, section)}
                else:
                    merged[section] = _default_of(section)
        raise AssertionError("unreachable: every reset removes one setting")

    # ------------------------------------------------------- model-dependent checks

    def slots_per_layer(self, num_experts: int, top_k: int) -> int:
        """Number of device cache slots per MoE layer for a model with ``num_experts``
        routed experts per layer and ``top_k`` experts per token."""
        if isinstance(self.budget, int):
            slots = self.budget
            given = f"budget {self.budget}"
        else:
            slots = math.floor(self.budget * num_experts + 1e-9)
            given = f"budget {self.budget} x {num_experts} experts = {slots} slots"
        if slots > num_experts:
            raise SpecExpertConfigError(
                "budget",
                f"{given} exceeds the {num_experts} routed experts per layer",
                f"use at most {num_experts} (or a fraction <= 1.0)",
            )
        if slots < top_k:
            raise SpecExpertConfigError(
                "budget",
                f"{given}, fewer than the model's top_k={top_k} experts per token "
                "(one token could not run)",
                f"use at least {top_k} slots, i.e. budget >= {top_k} "
                f"or >= {math.ceil(top_k / num_experts * 1000) / 1000}",
            )
        return slots


def _miss_policy_classes() -> dict:
    # Imported here: the policies import the engine's modules, which import this one.
    from vllm_specexpert.policy import MISS_POLICY_CLASSES

    return MISS_POLICY_CLASSES


def _default_of(name: str, section: str | None = None) -> Any:
    """The default of ``name``, a field of the config or of its ``section`` (a section
    as the plain dict :meth:`SpecExpertConfig.to_dict` gives)."""
    owner = _section_class(SpecExpertConfig, (section,)) if section else SpecExpertConfig
    value = owner.__pydantic_fields__[name].get_default(call_default_factory=True)
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


MAX_EXPERTS = 65536
"""The largest budget count accepted (no model has more routed experts per layer)."""


def _config_error(error: ValidationError, cls: type) -> SpecExpertConfigError:
    """The first of pydantic's errors as one :class:`SpecExpertConfigError`."""
    first = error.errors(include_url=False)[0]
    loc = tuple(part for part in first["loc"] if isinstance(part, str))  # no list indices
    field_name = ".".join(loc) or ADDITIONAL_CONFIG_KEY
    owner = _section_class(cls, loc[:-1])
    kind, value = first["type"], first.get("input")
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        known = ", ".join(f.name for f in dataclasses.fields(owner))
        return SpecExpertConfigError(field_name, "unknown key",
                                     f"remove it; known keys here are {known}")
    if kind == "value_error":
        problem = str(first["ctx"]["error"])
    else:
        shown = _shown(value)
        problem = f"{first['msg'][0].lower()}{first['msg'][1:]}, got {shown}"
    if kind == "literal_error":
        return SpecExpertConfigError(field_name, problem, "use one of those values")
    if kind in ("dataclass_type", "dict_type", "model_type"):
        return SpecExpertConfigError(field_name, problem, "give a JSON object ({} for the "
                                     "defaults)")
    if kind == "bool_type":
        return SpecExpertConfigError(field_name, problem, "give true or false")
    if kind == "string_type" or kind == "string_too_short":
        return SpecExpertConfigError(field_name, problem, "give a path (a non-empty string), "
                                     "or null")
    return SpecExpertConfigError(field_name, problem, _fix_from_docs(owner, loc[-1]))


def _shown(value: Any) -> str:
    """A rejected value as the user wrote it: ``8.0`` stays ``8.0`` (a float where a count
    is wanted), ``1e300`` is ``1e+300``, not 301 digits."""
    if isinstance(value, float) and math.isfinite(value):
        return repr(value) if abs(value) < 1e16 and value == float(f"{value:.6g}") \
            else f"{value:.6g}"
    return repr(value)


def _section_class(cls: type, loc: tuple) -> type:
    sections = {"link": LinkConfig, "buddy": BuddyConfig, "token_scheduler": TokenSchedulerConfig}
    return sections[loc[-1]] if loc and loc[-1] in sections else cls


def _fix_from_docs(owner: type, name: str) -> str:
    """The field's range from its docstring ("Range: ..."), or its first sentence."""
    info = owner.__pydantic_fields__.get(name)
    doc = " ".join((info.description or "").split()) if info is not None else ""
    match = re.search(r"Range: (.+?)\.(?:\s|$)", doc)
    if match:
        return f"the range is {match.group(1)}"
    first = re.split(r"(?<=\.)\s", doc)[0]
    return f"'{name}' is {first[0].lower()}{first[1:]}" if first else "see the config docs"


class SpecExpertUnsupportedError(ValueError):
    """The model or engine setup is one the plugin cannot run (yet)."""

    def __init__(self, what: str, why: str, fix: str):
        super().__init__(f"specexpert: {what} is not supported: {why}. Fix: {fix}")
