"""SpecExpertConfig: every knob of the plugin, its default, and its validation.

Users set it through vLLM's ``additional_config={"specexpert": {...}}`` (CLI:
``--additional-config '{"specexpert": {...}}'``). Validation happens in two steps, both at
engine start: :meth:`SpecExpertConfig.from_dict` checks keys, types and ranges;
:meth:`SpecExpertConfig.slots_per_layer` checks the budget against the model's shape.
Every error is a :class:`SpecExpertConfigError` that names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

ADDITIONAL_CONFIG_KEY = "specexpert"

CACHE_POLICIES = ("lru", "lfu", "static", "plec")
PREDICTORS = ("none", "router", "quasi_hidden")
PREFETCH_FILTERS = ("cost", "all")
PLEC_PRELOADS = ("none", "step", "next")


class SpecExpertConfigError(ValueError):
    """A bad ``specexpert`` setting. The message names the field and how to fix it."""

    def __init__(self, field_name: str, problem: str, fix: str):
        self.field_name = field_name
        super().__init__(f"specexpert config: field '{field_name}': {problem}. Fix: {fix}")


@dataclass(frozen=True)
class LinkConfig:
    """The emulated link between the slow tier and the device cache.

    On CUDA the real copy engine is used and these fields must be unset. On CPU, every
    expert copy is really performed, and when ``bandwidth_gbps`` is set the copy becomes
    usable only ``latency_us + bytes / bandwidth`` after the link is free, copies being
    serialized like one copy engine. This lets a CPU run reproduce a GPU box's ratio of
    copy time to compute time.
    """

    bandwidth_gbps: float | None = None
    """Emulated bandwidth in gigabytes per second (1e9 bytes/s, not gigabits).
    PCIe 4.0 x16 moves about 25 GB/s host-to-device in practice; PCIe 3.0 x16 about 12.
    ``None`` (default): no emulation, copies take what the memcpy takes."""

    latency_us: float = 0.0
    """Fixed emulated cost in microseconds of each copy (launch + DMA setup); an expert
    is one copy per weight tensor (2 for ``w13`` + ``w2``). Only used when
    ``bandwidth_gbps`` is set."""

    host_slowdown: float = 14.0
    """Emulated speed of the host for the ``cpu`` and ``auto`` miss policies: an expert
    computed on the host from the slow tier counts as ready only ``host_slowdown`` times
    its measured time on this processor after it started (the device ran the hits
    meanwhile). Default 14: decode-time expert compute is memory-bound, and an
    RTX-4090-class GPU (~1000 GB/s) reads weights about 14x faster than a dual-channel
    DDR5 desktop CPU (~70 GB/s) (an estimate). Only used when ``bandwidth_gbps`` is set;
    without emulation the host compute takes what it takes."""

    @property
    def emulated(self) -> bool:
        return self.bandwidth_gbps is not None


@dataclass(frozen=True)
class TokenSchedulerConfig:
    """The token scheduler (ExpertFlow §3.3; ``token_scheduler: {}`` for these defaults).
    When more decode sequences are runnable than ``group_size``, each step runs one group
    of them whose predicted routes (``path_predictor``) overlap most; the others keep
    their KV blocks and wait. Prefill is never held back."""

    group_size: int = 8
    """Decode sequences run per step when more are runnable (1 <= group_size <= 4096)."""
    max_wait_steps: int = 4
    """Consecutive steps a runnable decode sequence may be held back (0 <= n <= 1000):
    once it has waited this long it runs in the next step's group, whatever its route."""


@dataclass(frozen=True)
class BuddyConfig:
    """BuddyMoE's substitution settings (``buddy``, ``auto_buddy`` and ``random`` miss
    policies; ``../shared/papers/buddymoe.txt`` §3). Defaults: the paper's best setting
    (α = 0.95, |B| <= 16, ρ = 3) and a TAE gate at the 15th percentile (its 10-20 range)."""

    alpha: float = 0.95
    """Cumulative Frequency Threshold of the buddy lists, in (0, 1]: an expert's buddies are
    its most co-activated peers until their share of its co-activations reaches alpha."""

    k_max: int = 16
    """Longest buddy list per expert."""

    tau: float | None = None
    """Token Activating Entropy gate in [0, 1]: a token whose normalised routing entropy
    is <= tau keeps its experts (fetch). ``None`` (default): per layer, the
    ``tau_percentile``-th percentile of the calibration's TAE distribution."""

    tau_percentile: float = 15.0
    """Percentile (0-100) of each layer's calibrated TAE used as tau when ``tau`` is
    unset: about this share of tokens is never substituted."""

    beta: float = 0.75
    """Batch distribution gate in (0, 1]: no substitution in a layer call where this share
    or more of the distinct requested experts is missing (broad substitution compounds
    errors; the paper leaves the value to the deployment, this default is ours)."""

    rho: int = 3
    """Replacement budget: at most this many substituted experts per token."""


@dataclass(frozen=True)
class SpecExpertConfig:
    """Configuration of the offload-aware MoE layer. Every field has a safe default."""

    budget: float | int = 0.5
    """How many routed experts of each MoE layer may be resident on the device.
    A float in (0, 1] is a fraction of the layer's routed experts (rounded down);
    an int >= 2 is a count per layer (``1`` reads as 1.0, all experts). Must leave room for at least ``top_k`` experts
    (one token's experts) and cannot exceed the number of experts. 1.0 keeps every
    expert resident (no transfers after warm-up)."""

    cache: str = "lru"
    """Eviction policy of the device cache: ``lru`` (least recently used), ``lfu``
    (least frequently used, ties by recency) or ``static`` (the first
    ``slots - top_k`` experts stay resident for good; the remaining ``top_k`` slots
    rotate, LRU, for the others): a fixed number of slots per layer. ``plec``
    (ExpertFlow's predictive locality-aware cache; needs ``path_predictor``): every
    layer's slots in one pool of the same total size, going to whichever layer the
    predicted demand of the step wants; the step's predicted experts are prefetched
    when it starts, and a load evicts the (layer, expert) with the fewest predicted uses
    still to come, the least recently used among equals. Exact under ``fetch``."""

    miss_policy: str = "fetch"
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

    predictor: str = "none"
    """How the next layer's experts are predicted, for prefetching (and for
    ``speculate``): ``none`` (no prefetch: on-demand loading only), ``router`` (next
    layer's router on this layer's router input s_l), ``quasi_hidden`` (next router on
    q_l = LN_{l+1}(d_l + r_l) with default vectors d from ``calibration``)."""

    plec_preload: str = "none"
    """What ``cache: plec`` loads ahead of demand, beyond choosing victims by the
    predicted uses still to come. ``none`` (default): nothing. ``step``: when a step
    starts, the predicted experts of its later layers, into slots that hold nothing
    predicted. ``next``: that, and under the token scheduler, after each layer the
    predicted experts of the group expected to run next step. Measured on the embedded
    model (``benchmarks/results/batched.json``), preloading raised hit rates but not
    throughput, and under the token scheduler it moved up to 21 % more bytes
    (mispredicted experts), hence the default."""

    prefetch_filter: str = "cost"
    """Which predicted experts ``fetch`` prefetches. ``cost`` (default): only those
    whose chance of being used (the layer's measured precision per predicted rank)
    pays for their link time, ``p > t_copy / (t_copy + min(t_copy, t_window))``: a
    wrong prefetch occupies the link that the true misses then wait for. ``all``: every
    predicted expert, as in the paper. Under ``speculate`` all predicted experts are
    prefetched either way (they all run)."""

    calibration: str | None = None
    """Directory written by ``specexpert calibrate`` for this model (default vectors,
    routing counts, co-activation). Required by ``predictor: quasi_hidden``."""

    path_predictor: str | None = None
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

    exact_layers: tuple[int, ...] | None = None
    """Decoder-layer indices that always run their router's experts under
    ``speculate``. ``None`` (default): the first MoE layer only (it has no previous
    layer to predict it anyway)."""

    admit_host_experts: bool = False
    """Under ``cpu``, ``auto`` and ``auto_buddy``: after a layer call computed missing
    experts on the host, load the one with the most tokens into the cache in the
    background if the link is idle (evicting by ``cache`` policy), so that the cache keeps
    following the routing as it does under ``fetch``. Off by default: on the embedded
    model it cut host entries by 20-40 % but its effect on tok/s stayed within run-to-run
    noise (-10 % to +5 %, ``benchmarks/results/miss_policies.json`` and one earlier run),
    and it makes the host/device split, hence the rounding, depend on timing. Off, the
    cache keeps its warm-start experts under ``cpu`` (static placement, as in
    llama.cpp/KTransformers)."""

    buddy: BuddyConfig = field(default_factory=BuddyConfig)
    """Substitution settings of ``buddy``, ``auto_buddy`` and ``random``, see
    :class:`BuddyConfig`."""

    link: LinkConfig = field(default_factory=LinkConfig)
    """Emulated link (CPU only), see :class:`LinkConfig`."""

    stats_path: str | None = None
    """If set, per-layer statistics (hits, misses, bytes moved, seconds stalled) are
    written there as JSON by each worker (``{rank}`` in the path is replaced by the
    worker rank), every ``stats_interval_s`` and at every ``specexpert_stats`` call."""

    stats_interval_s: float = 10.0
    """Minimum seconds between two periodic writes of ``stats_path``."""

    # ------------------------------------------------------------------ parsing

    @classmethod
    def from_dict(cls, raw: Any) -> SpecExpertConfig:
        """Build and validate a config from the user's ``specexpert`` dict."""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise SpecExpertConfigError(
                ADDITIONAL_CONFIG_KEY,
                f"must be a JSON object, got {type(raw).__name__}",
                'pass e.g. {"specexpert": {"budget": 0.5}}',
            )
        _reject_unknown(raw, cls, prefix="")
        kwargs: dict[str, Any] = {}

        if "budget" in raw:
            kwargs["budget"] = _parse_budget(raw["budget"])
        if "cache" in raw:
            kwargs["cache"] = _parse_choice("cache", raw["cache"], CACHE_POLICIES)
        if "miss_policy" in raw:
            kwargs["miss_policy"] = _parse_choice(
                "miss_policy", raw["miss_policy"], tuple(_miss_policy_classes())
            )
        if "predictor" in raw:
            kwargs["predictor"] = _parse_choice("predictor", raw["predictor"], PREDICTORS)
        if "plec_preload" in raw:
            kwargs["plec_preload"] = _parse_choice("plec_preload", raw["plec_preload"],
                                                   PLEC_PRELOADS)
        if "prefetch_filter" in raw:
            kwargs["prefetch_filter"] = _parse_choice("prefetch_filter", raw["prefetch_filter"],
                                                      PREFETCH_FILTERS)
        if "calibration" in raw:
            kwargs["calibration"] = _parse_optional_path("calibration", raw["calibration"],
                                                         'e.g. "calibration": "/path/to/calib"')
        if "path_predictor" in raw:
            kwargs["path_predictor"] = _parse_optional_path(
                "path_predictor", raw["path_predictor"], 'e.g. "path_predictor": "/path/to/rpp"')
        if raw.get("token_scheduler") is not None:
            kwargs["token_scheduler"] = _parse_token_scheduler(raw["token_scheduler"])
        if "exact_layers" in raw:
            kwargs["exact_layers"] = _parse_layers("exact_layers", raw["exact_layers"])
        if "admit_host_experts" in raw:
            if not isinstance(raw["admit_host_experts"], bool):
                raise SpecExpertConfigError(
                    "admit_host_experts", f"must be true or false, got {raw['admit_host_experts']!r}",
                    "give a boolean")
            kwargs["admit_host_experts"] = raw["admit_host_experts"]
        if "link" in raw:
            kwargs["link"] = _parse_link(raw["link"])
        if "buddy" in raw:
            kwargs["buddy"] = _parse_buddy(raw["buddy"])
        if "stats_path" in raw:
            kwargs["stats_path"] = _parse_optional_path(
                "stats_path", raw["stats_path"], 'e.g. "stats_path": "/tmp/specexpert-stats.json"')
        if "stats_interval_s" in raw:
            kwargs["stats_interval_s"] = _parse_number(
                "stats_interval_s", raw["stats_interval_s"], minimum=0.0, inclusive=True
            )
        config = cls(**kwargs)
        config._check_combination()
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


def _reject_unknown(raw: dict, cls: type, prefix: str) -> None:
    known = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in known:
            raise SpecExpertConfigError(
                f"{prefix}{key}",
                "unknown key",
                f"remove it; known keys are {', '.join(prefix + k for k in known)}",
            )


def _parse_budget(value: Any) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecExpertConfigError(
            "budget",
            f"must be a number, got {value!r}",
            "use a fraction in (0, 1], e.g. 0.5, or an integer count of experts per layer",
        )
    if isinstance(value, float) and value.is_integer() and value > 1:
        value = int(value)
    if isinstance(value, int):
        if value < 1:
            raise SpecExpertConfigError(
                "budget", f"count must be >= 1, got {value}",
                "use a positive count, or a fraction in (0, 1]",
            )
        if value == 1:
            # JSON cannot tell 1 from 1.0: read it as the fraction (all experts resident).
            return 1.0
        return value
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise SpecExpertConfigError(
            "budget", f"fraction must be in (0, 1], got {value}",
            "use e.g. 0.25, 0.5 or 1.0, or an integer count of experts per layer",
        )
    return float(value)


def _parse_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise SpecExpertConfigError(
            name, f"unsupported value {value!r}", f"use one of {', '.join(choices)}"
        )
    return value


def _parse_number(name: str, value: Any, minimum: float, inclusive: bool,
                  integer: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise SpecExpertConfigError(name, f"must be a number, got {value!r}", "give a number")
    if integer and not float(value).is_integer():
        raise SpecExpertConfigError(name, f"must be an integer, got {value!r}", "give an integer")
    ok = value >= minimum if inclusive else value > minimum
    if not ok:
        bound = ">=" if inclusive else ">"
        raise SpecExpertConfigError(
            name, f"must be {bound} {minimum}, got {value}", f"give a value {bound} {minimum}"
        )
    return float(value)


def _parse_optional_path(name: str, value: Any, example: str) -> str | None:
    if value is not None and not (isinstance(value, str) and value):
        raise SpecExpertConfigError(name, f"must be a non-empty string or null, got {value!r}",
                                    f"give a path, {example}")
    return value


def _parse_layers(name: str, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise SpecExpertConfigError(name, f"must be a list of layer indices, got {value!r}",
                                    "give decoder-layer indices, e.g. [0, 1]")
    return tuple(sorted(set(value)))


def _parse_link(raw: Any) -> LinkConfig:
    if raw is None:
        return LinkConfig()
    if not isinstance(raw, dict):
        raise SpecExpertConfigError(
            "link", f"must be an object, got {raw!r}",
            'use e.g. {"bandwidth_gbps": 16, "latency_us": 10}',
        )
    _reject_unknown(raw, LinkConfig, prefix="link.")
    bandwidth = raw.get("bandwidth_gbps")
    if bandwidth is not None:
        bandwidth = _parse_number("link.bandwidth_gbps", bandwidth, 0.0, inclusive=False)
    latency = _parse_number("link.latency_us", raw.get("latency_us", 0.0), 0.0, inclusive=True)
    kwargs = {}
    if "host_slowdown" in raw:
        if bandwidth is None and raw["host_slowdown"] != LinkConfig.host_slowdown:
            raise SpecExpertConfigError(
                "link.host_slowdown", "only applies to an emulated link, and bandwidth_gbps is unset",
                "set link.bandwidth_gbps too, or remove host_slowdown",
            )
        kwargs["host_slowdown"] = _parse_number("link.host_slowdown", raw["host_slowdown"], 1.0,
                                                inclusive=True)
    return LinkConfig(bandwidth_gbps=bandwidth, latency_us=latency, **kwargs)


def _parse_token_scheduler(raw: Any) -> TokenSchedulerConfig:
    if not isinstance(raw, dict):
        raise SpecExpertConfigError(
            "token_scheduler", f"must be an object, got {raw!r}",
            'use {} for the defaults, or e.g. {"group_size": 8, "max_wait_steps": 4}')
    _reject_unknown(raw, TokenSchedulerConfig, prefix="token_scheduler.")
    kwargs = {}
    for name, low, high in (("group_size", 1, 4096), ("max_wait_steps", 0, 1000)):
        if name in raw:
            value = int(_parse_number(f"token_scheduler.{name}", raw[name], low, inclusive=True,
                                      integer=True))
            if value > high:
                raise SpecExpertConfigError(f"token_scheduler.{name}",
                                            f"must be at most {high}, got {value}",
                                            f"give a value in [{low}, {high}]")
            kwargs[name] = value
    return TokenSchedulerConfig(**kwargs)


def _parse_buddy(raw: Any) -> BuddyConfig:
    if raw is None:
        return BuddyConfig()
    if not isinstance(raw, dict):
        raise SpecExpertConfigError(
            "buddy", f"must be an object, got {raw!r}", 'use e.g. {"alpha": 0.95, "rho": 3}')
    _reject_unknown(raw, BuddyConfig, prefix="buddy.")
    kwargs: dict[str, Any] = {}
    if "alpha" in raw:
        kwargs["alpha"] = _parse_fraction("buddy.alpha", raw["alpha"], zero_ok=False)
    if "k_max" in raw:
        kwargs["k_max"] = int(_parse_number("buddy.k_max", raw["k_max"], 1, True, integer=True))
    if raw.get("tau") is not None:
        kwargs["tau"] = _parse_fraction("buddy.tau", raw["tau"], zero_ok=True)
    if "tau_percentile" in raw:
        value = _parse_number("buddy.tau_percentile", raw["tau_percentile"], 0.0, True)
        if value > 100:
            raise SpecExpertConfigError("buddy.tau_percentile", f"must be <= 100, got {value}",
                                        "give a percentile in [0, 100], e.g. 15")
        kwargs["tau_percentile"] = value
    if "beta" in raw:
        kwargs["beta"] = _parse_fraction("buddy.beta", raw["beta"], zero_ok=False)
    if "rho" in raw:
        kwargs["rho"] = int(_parse_number("buddy.rho", raw["rho"], 1, True, integer=True))
    return BuddyConfig(**kwargs)


def _parse_fraction(name: str, value: Any, zero_ok: bool) -> float:
    value = _parse_number(name, value, 0.0, inclusive=zero_ok)
    if value > 1.0:
        low = "[0" if zero_ok else "(0"
        raise SpecExpertConfigError(name, f"must be in {low}, 1], got {value}",
                                    f"give a value in {low}, 1]")
    return value


class SpecExpertUnsupportedError(ValueError):
    """The model or engine setup is one the plugin cannot run (yet)."""

    def __init__(self, what: str, why: str, fix: str):
        super().__init__(f"specexpert: {what} is not supported: {why}. Fix: {fix}")
