"""The two rules on top of the schema: a setting that needs another one, and a setting
that must do something under the chosen mode (see :mod:`vllm_specexpert.config`)."""

from __future__ import annotations

import dataclasses
from typing import Protocol

from vllm_specexpert.config.errors import SpecExpertConfigError
from vllm_specexpert.config.modes import (
    MISS_POLICIES,
    CacheSpec,
    MissPolicySpec,
    PredictorSpec,
)
from vllm_specexpert.config.sections import (
    BuddyConfig,
    DiskConfig,
    LinkConfig,
    LookaheadConfig,
    MeshConfig,
    QualityConfig,
    TokenSchedulerConfig,
    default_of,
)


class Settings(Protocol):
    """What the rules read of a :class:`~vllm_specexpert.config.SpecExpertConfig` (the
    config module imports this one, not the other way round). Read-only: the config's
    fields may be narrower (a ``Literal`` of mode names where this says ``str``)."""

    @property
    def budget(self) -> float | int | str: ...
    @property
    def allow_budget_beyond_memory(self) -> bool: ...
    @property
    def miss_policy(self) -> str: ...
    @property
    def predictor(self) -> str: ...
    @property
    def cache(self) -> str: ...
    @property
    def calibration(self) -> str | None: ...
    @property
    def estimator(self) -> str | None: ...
    @property
    def analysis(self) -> str | None: ...
    @property
    def router_free(self) -> bool: ...
    @property
    def path_predictor(self) -> str | None: ...
    @property
    def token_scheduler(self) -> TokenSchedulerConfig | None: ...
    @property
    def lookahead(self) -> LookaheadConfig | None: ...
    @property
    def mesh(self) -> MeshConfig | None: ...
    @property
    def quality(self) -> QualityConfig | None: ...
    @property
    def disk(self) -> DiskConfig | None: ...
    @property
    def output(self) -> str: ...
    @property
    def link(self) -> LinkConfig: ...
    @property
    def buddy(self) -> BuddyConfig: ...
    @property
    def stats_path(self) -> str | None: ...
    @property
    def miss_policy_spec(self) -> MissPolicySpec: ...
    @property
    def predictor_spec(self) -> PredictorSpec: ...
    @property
    def cache_spec(self) -> CacheSpec: ...
    @property
    def routing_statistics_need(self) -> str | None: ...


CALIBRATE = 'run `specexpert calibrate MODEL --out DIR` and set "calibration": "DIR"'


def _policies_with(trait: str) -> str:
    """The miss policies that have ``trait``, for a fix: "cpu, auto or auto_buddy"."""
    names = [name for name, spec in MISS_POLICIES.items() if getattr(spec, trait)]
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def check_combination(config: Settings) -> None:
    """Settings that need another one (a predictor, a calibration, a path predictor)."""
    policy = config.miss_policy_spec
    if policy.needs_predictor and not config.predictor_spec.predicts:
        raise SpecExpertConfigError(
            "miss_policy",
            f"'{policy.name}' runs predicted experts, but 'predictor' is '{config.predictor}'",
            'set "predictor": "router" or "quasi_hidden"',
        )
    why = config.routing_statistics_need
    if why is not None and config.calibration is None:
        raise SpecExpertConfigError(
            "calibration",
            f"miss_policy '{config.miss_policy}' needs a calibration: {why}",
            CALIBRATE,
        )
    if config.predictor_spec.needs_calibration and config.calibration is None:
        raise SpecExpertConfigError(
            "calibration",
            f"predictor '{config.predictor}' needs default vectors, and none is set",
            CALIBRATE,
        )
    predictor = config.predictor_spec
    if predictor.needs_estimator and config.estimator is None:
        raise SpecExpertConfigError(
            "estimator",
            f"predictor '{config.predictor}' runs the neural expert estimator, and none is set",
            'run `specexpert train-estimator MODEL --out DIR` and set "estimator": "DIR"',
        )
    if predictor.needs_analysis and config.analysis is None:
        raise SpecExpertConfigError(
            "analysis",
            f"predictor '{config.predictor}' chooses its estimator layers by "
            "the recall `specexpert analyze` measured, and no analysis is set",
            "run `specexpert analyze MODEL --calibration DIR --out ADIR` and set "
            '"analysis": "ADIR", or use predictor \'estimator\'',
        )
    if (
        config.cache_spec.needs_path_predictor
        and config.path_predictor is None
        and config.lookahead is None
    ):
        raise SpecExpertConfigError(
            "cache",
            f"'{config.cache}' allocates slots by the predicted demand of each "
            "step, and neither a path predictor nor a lookahead draft predicts it",
            'set "path_predictor": "DIR" (from `specexpert train-path MODEL --out '
            "DIR`) or \"lookahead\": {}, or use cache 'lrfu'",
        )
    lookahead = config.lookahead
    if lookahead is not None and lookahead.k is not None and lookahead.k > lookahead.k_max:
        raise SpecExpertConfigError(
            "lookahead.k",
            f"{lookahead.k} exceeds lookahead.k_max={lookahead.k_max}",
            f"use k <= {lookahead.k_max}, or raise k_max",
        )
    _check_mesh(config)
    _check_disk(config)
    if config.token_scheduler is not None and config.path_predictor is None:
        raise SpecExpertConfigError(
            "path_predictor",
            "token_scheduler groups sequences by predicted route, and no path predictor is set",
            'run `specexpert train-path MODEL --out DIR` and set "path_predictor": "DIR"',
        )


def _check_disk(config: Settings) -> None:
    """What the disk tier does not combine with yet, and why."""
    if config.disk is None:
        return
    policy = config.miss_policy_spec
    refusals = [
        (
            policy.computes_on_host,
            "miss_policy",
            f"'{config.miss_policy}' computes missing experts on the host from host "
            "memory, and under the disk tier they are on disk (computing them where they "
            "are is not built)",
        ),
        (
            policy.low_bit,
            "miss_policy",
            "'lowbit' keeps an INT4 copy of every expert in memory, made from the loaded "
            "weights, which the disk tier never loads (INT4 copies on disk are not built)",
        ),
        (
            config.mesh is not None,
            "mesh",
            "the peers load their shards from the checkpoint and the engine keeps the hot "
            "experts in memory (a mesh over the disk tier is not built)",
        ),
        (
            config.link.emulated,
            "link.bandwidth_gbps",
            "the disk is the real link: its reads take what they take",
        ),
    ]
    for refused, field, why in refusals:
        if refused:
            raise SpecExpertConfigError(
                field, f"does not combine with disk: {why}", "remove one of the two"
            )
    if config.disk.residency != "mapped":
        return
    mapped = [
        (config.miss_policy != "fetch", "miss_policy", f"'{config.miss_policy}'"),
        (config.path_predictor is not None, "path_predictor", "a path predictor"),
        (config.lookahead is not None, "lookahead", "a lookahead draft"),
        (config.cache_spec.shared_pool, "cache", f"'{config.cache}'"),
    ]
    for refused, field, what in mapped:
        if refused:
            raise SpecExpertConfigError(
                field,
                f"{what} does not combine with disk.residency 'mapped': every expert is "
                "addressable in the mapping, the page cache decides what is in memory, so "
                "there is no miss to decide on and no slot to keep or load ahead (a "
                "predictor's prefetch is a read-ahead of the pages there)",
                "remove it, or use disk.residency 'slots'",
            )


def _policies_with_output(output: str) -> str:
    names = [name for name, spec in MISS_POLICIES.items() if spec.output == output]
    return ", ".join(names)


def _check_mesh(config: Settings) -> None:
    mesh = config.mesh
    if mesh is None:
        return
    if mesh.mode != "sync" and not config.predictor_spec.predicts:
        raise SpecExpertConfigError(
            "mesh.mode",
            f"'{mesh.mode}' sends rows ahead to the peers of predicted experts, "
            f"but 'predictor' is '{config.predictor}'",
            'set "predictor": "quasi_hidden" or "router", or use mesh mode "sync"',
        )
    if mesh.placement == "replicate_hot" and config.calibration is None:
        raise SpecExpertConfigError(
            "calibration",
            "mesh placement 'replicate_hot' ranks each layer's experts by "
            "the calibration's routing counts, and none is set",
            CALIBRATE,
        )
    if config.lookahead is not None:
        # (The draft itself needs no peers: its INT4 experts are all on the engine.)
        raise SpecExpertConfigError(
            "mesh",
            "does not combine with lookahead yet (the draft's routes act by prefetching "
            "over the link, and under a mesh a missing expert is computed by its peer, not "
            "loaded; sending the verification pass's rows to the peers ahead is not built)",
            "remove one of the two",
        )


def check_effect(config: Settings, explicit: set[str]) -> None:
    """A setting the user gave a value other than its default must do something
    under the chosen mode."""
    policy = config.miss_policy_spec

    def given(key: str) -> bool:
        """``key`` (a setting, a section, or ``section.setting``) was given a value other
        than its default."""
        section, _, name = key.partition(".")
        if section not in explicit:
            return False
        mine = getattr(config, section)
        if not dataclasses.is_dataclass(mine):
            return mine != default_of(type(config), key)
        if not name and default_of(type(config), section) is None:
            return True  # (an optional section, on)
        names = [name] if name else [f.name for f in dataclasses.fields(mine)]
        return any(getattr(mine, n) != default_of(type(mine), n) for n in names)

    def needs(key: str, what: str, fix: str) -> None:
        if given(key):
            raise SpecExpertConfigError(key, f"has no effect {what}", fix)

    if config.disk is not None and config.disk.residency == "mapped":
        for key in ("budget", "cache"):
            needs(
                key,
                "with disk.residency 'mapped' (the kernel addresses every expert in the "
                "mapping and the page cache decides what stays in memory: there is no slot "
                "to size or keep; should the mapping be refused at start, the slots it falls "
                "back to are sized by budget 'auto' and kept by cache 'lrfu')",
                "remove it, or use disk.residency 'slots'",
            )
    if config.budget == "auto":
        needs(
            "allow_budget_beyond_memory",
            "with budget 'auto' (it only lets an explicit budget exceed what fits)",
            "give an explicit budget, or remove it",
        )
    if not config.link.emulated:
        for key in ("link.latency_us", "link.host_slowdown"):
            needs(
                key,
                "without an emulated link (link.bandwidth_gbps is unset)",
                "set link.bandwidth_gbps too, or remove it",
            )
    if not policy.computes_elsewhere:
        needs(
            "admit_host_experts",
            f"under miss_policy '{config.miss_policy}' (it admits "
            "experts computed on the host or from INT4 copies)",
            f"use miss_policy {_policies_with('computes_elsewhere')}, or remove it",
        )
    if not policy.substitutes:
        needs(
            "buddy",
            f"under miss_policy '{config.miss_policy}' (it tunes substitution)",
            f"use miss_policy {_policies_with('substitutes')}, or remove it",
        )
    if given("buddy.tau") and given("buddy.tau_percentile") and config.buddy.tau is not None:
        raise SpecExpertConfigError(
            "buddy.tau_percentile",
            "has no effect when buddy.tau is set (the percentile "
            "only chooses tau when it is unset)",
            "remove one of the two",
        )
    if not policy.speculates:
        needs(
            "exact_layers",
            f"under miss_policy '{config.miss_policy}' (only speculate runs predicted experts)",
            f"use miss_policy {_policies_with('speculates')}, or remove it",
        )
    if not config.predictor_spec.predicts:
        needs(
            "prefetch_filter",
            "with predictor 'none' (nothing is prefetched)",
            "set predictor 'router' or 'quasi_hidden', or remove it",
        )
    # estimator, analysis and hybrid_threshold are read at start, like calibration,
    # whatever the predictor: reconfigure may switch to estimator or hybrid later.
    if not config.predictor_spec.needs_estimator:
        needs(
            "router_free",
            f"with predictor '{config.predictor}' (only estimator and "
            "hybrid predict with the estimator)",
            "set predictor 'estimator' or 'hybrid', or remove it",
        )
    if not policy.speculates:
        needs(
            "router_free",
            f"under miss_policy '{config.miss_policy}' (only speculate "
            "runs the predicted routing instead of the router's)",
            "use miss_policy 'speculate', or remove it",
        )
    if not config.cache_spec.shared_pool:
        needs("plec_preload", f"with cache '{config.cache}'", "use cache 'plec', or remove it")
    if (
        config.mesh is not None
        and config.mesh.placement != "replicate_hot"
        and "mesh" in explicit
        and config.mesh.hot_count != default_of(type(config.mesh), "hot_count")
    ):
        raise SpecExpertConfigError(
            "mesh.hot_count",
            f"has no effect with placement '{config.mesh.placement}'",
            "set mesh.placement to 'replicate_hot', or remove it",
        )
    if config.stats_path is None:
        needs("stats_interval_s", "without stats_path", "set stats_path, or remove it")
    if config.output != "approximate" and config.quality is not None:
        # (``null`` is no setting of a budget: it keeps the next approximate mode unbudgeted)
        needs(
            "quality",
            f"under miss_policy '{config.miss_policy}', which is {config.output} "
            "(there is nothing to budget; the default budget waits for an approximate mode)",
            "remove quality, or use a miss_policy that changes the output "
            f"({_policies_with_output('approximate')})",
        )
    if config.lookahead is not None and config.disk is None:
        needs(
            "lookahead.draft_cache",
            "without disk (it sizes the draft's INT4 experts held in memory above the "
            "disk; without it every one of them is in memory)",
            "set disk, or remove it",
        )
