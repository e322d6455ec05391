import json

import pytest

from vllm_specexpert.config import (
    LinkConfig,
    SpecExpertConfig,
    SpecExpertConfigError,
)
from vllm_specexpert.config.modes import MISS_POLICIES
from vllm_specexpert.config.sections import QualityConfig

LONG_DIRECTORY = "/" + "/".join(["d" * 250] * 16) + "/" + "d" * (4085 - 4017)


def test_defaults_are_valid():
    config = SpecExpertConfig.from_dict({})
    assert config.budget == "auto"
    assert config.cache == "lrfu"
    assert config.miss_policy == "fetch"
    assert config.link == LinkConfig()


def test_absent_key_means_inert():
    assert SpecExpertConfig.from_additional_config({}) is None
    assert SpecExpertConfig.from_additional_config({"other": 1}) is None
    assert SpecExpertConfig.from_additional_config({"specexpert": {}}) is not None


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"budgt": 0.5}, "budgt"),
        ({"budget": "half"}, "budget"),
        ({"budget": True}, "budget"),
        ({"budget": 0.0}, "budget"),
        ({"budget": 1.5}, "budget"),
        ({"budget": -3}, "budget"),
        ({"cache": "fifo"}, "cache"),
        ({"miss_policy": "guess"}, "miss_policy"),
        ({"link": {"bandwidth_gbps": 0}}, "link.bandwidth_gbps"),
        ({"link": {"bandwith_gbps": 10}}, "link.bandwith_gbps"),
        ({"link": {"latency_us": -1}}, "link.latency_us"),
        ({"link": "fast"}, "link"),
        ({"link": {"host_slowdown": 10}}, "link.host_slowdown"),  # no emulated link
        ({"link": {"bandwidth_gbps": 1, "host_slowdown": 0.5}}, "link.host_slowdown"),
        ({"miss_policy": "buddy"}, "calibration"),
        ({"miss_policy": "auto_buddy"}, "calibration"),
        ({"miss_policy": "random"}, "calibration"),  # tau from calibrated percentiles
        ({"buddy": {"alpha": 0}}, "buddy.alpha"),
        ({"buddy": {"alpha": 1.5}}, "buddy.alpha"),
        ({"buddy": {"tau": 2}}, "buddy.tau"),
        ({"buddy": {"tau_percentile": 150}}, "buddy.tau_percentile"),
        ({"buddy": {"beta": 0}}, "buddy.beta"),
        ({"buddy": {"rho": 0}}, "buddy.rho"),
        ({"buddy": {"k_max": 2.5}}, "buddy.k_max"),
        ({"buddy": {"kmax": 4}}, "buddy.kmax"),
        ({"buddy": [1]}, "buddy"),
        ({"admit_host_experts": "yes"}, "admit_host_experts"),
        ({"stats_path": 3}, "stats_path"),
        ({"stats_interval_s": -1}, "stats_interval_s"),
        ({"disk": {"path": "/p", "queue_depth": "4"}}, "disk.queue_depth"),
        ({"disk": {"path": "/p", "queue_depth": True}}, "disk.queue_depth"),
        ({"disk": {"path": "/p", "queue_depth": 4.0}}, "disk.queue_depth"),
        ({"disk": {"path": "/p", "direct": "yes"}}, "disk.direct"),
        ({"disk": {"path": "/p", "direct": 1}}, "disk.direct"),
        ({"disk": {"path": "/p", "direct": "false"}}, "disk.direct"),
        ({"disk": {"path": "/p", "read_ahead_rows": -1}}, "disk.read_ahead_rows"),
        ({"disk": {"path": "/p", "read_ahead_rows": "8"}}, "disk.read_ahead_rows"),
        ({"disk": {"path": "/p", "read_ahead_rows": "max"}}, "disk.read_ahead_rows"),
        ({"budget": "auto "}, "budget"),  # (as "0.25 " is: a string is read as written)
        ({"budget": " 12GiB"}, "budget"),
        ({"disk": {"path": "/tmp/a\0b"}}, "disk.path"),
        ({"disk": {"path": "/tmp/" + "x" * 5000}}, "disk.path"),
        ({"disk": {"path": "/tmp/" + "x" * 300 + "/pack"}}, "disk.path"),
        ({"calibration": "/tmp/a\0b"}, "calibration"),
        # Near the path limit, every part short: the pack's files in it would not fit.
        ({"disk": {"path": LONG_DIRECTORY}}, "disk.path"),
        ({"disk": {"path": LONG_DIRECTORY[:4095]}}, "disk.path"),
        ({"path_predictor": LONG_DIRECTORY}, "path_predictor"),
    ],
)
def test_bad_values_name_the_field(raw, field):
    with pytest.raises(SpecExpertConfigError) as info:
        SpecExpertConfig.from_dict(raw)
    assert info.value.field_name == field
    assert f"field '{field}'" in str(info.value)
    assert "Fix:" in str(info.value)


def test_every_file_the_plugin_keeps_in_a_given_directory_fits_the_paths_it_leaves():
    from vllm_specexpert import calibration
    from vllm_specexpert.config.sections import FILE_IN_DIRECTORY_MAX
    from vllm_specexpert.predict import estimator_network, hybrid, path
    from vllm_specexpert.tiers import expert_pack, pack_writer

    names = [
        *pack_writer.OWN_FILES,
        calibration.WEIGHTS_FILE,
        path.WEIGHTS_FILE,
        estimator_network.WEIGHTS_FILE,
        hybrid.ANALYSIS_FILE,
        expert_pack.MANIFEST_FILE,  # (every artifact's manifest)
    ]
    assert max(len(name.encode()) for name in names) <= FILE_IN_DIRECTORY_MAX
    fits = LONG_DIRECTORY[: 4095 - 2 - FILE_IN_DIRECTORY_MAX]  # (the longest given)
    assert SpecExpertConfig.from_dict({"disk": {"path": fits}}).disk.path == fits


def test_not_an_object():
    with pytest.raises(SpecExpertConfigError, match="JSON object"):
        SpecExpertConfig.from_dict([0.5])


@pytest.mark.parametrize(
    "budget, experts, top_k, slots",
    [
        (1.0, 16, 4, 16),
        (0.5, 16, 4, 8),
        (0.25, 16, 4, 4),
        (0.3, 10, 2, 3),
        (6, 16, 2, 6),
        (1, 8, 2, 8),
    ],
)
def test_slots_per_layer(budget, experts, top_k, slots):
    assert SpecExpertConfig.from_dict({"budget": budget}).slots_per_layer(experts, top_k) == slots


def test_budget_below_top_k_is_rejected_with_the_minimum():
    config = SpecExpertConfig.from_dict({"budget": 0.1})
    with pytest.raises(SpecExpertConfigError, match="top_k=4") as info:
        config.slots_per_layer(16, 4)
    assert "budget >= 4 or >= 0.25" in str(info.value)


def test_budget_count_above_experts_is_rejected():
    with pytest.raises(SpecExpertConfigError, match="exceeds the 16 routed experts"):
        SpecExpertConfig.from_dict({"budget": 20}).slots_per_layer(16, 2)


def test_link_parsing():
    link = SpecExpertConfig.from_dict({"link": {"bandwidth_gbps": 16, "latency_us": 5}}).link
    assert link.emulated and link.bandwidth_gbps == 16.0 and link.latency_us == 5.0
    assert not SpecExpertConfig.from_dict({"link": {}}).link.emulated


def test_miss_policy_outputs_and_buddy_parsing():
    outputs = {
        p: SpecExpertConfig.from_dict(
            {"miss_policy": p, "calibration": "c", "predictor": "router"}
        ).output
        for p in ("fetch", "cpu", "auto", "buddy", "random", "drop", "speculate")
    }
    assert outputs == {
        "fetch": "exact",
        "cpu": "equivalent",
        "auto": "equivalent",
        "buddy": "approximate",
        "random": "approximate",
        "drop": "approximate",
        "speculate": "approximate",
    }
    buddy = SpecExpertConfig.from_dict(
        {
            "miss_policy": "random",
            "buddy": {"tau": 0.5, "rho": 2, "beta": 1, "alpha": 0.9, "k_max": 4},
        }
    ).buddy
    assert (buddy.tau, buddy.rho, buddy.beta, buddy.alpha, buddy.k_max) == (0.5, 2, 1.0, 0.9, 4)
    link = SpecExpertConfig.from_dict({"link": {"bandwidth_gbps": 1, "host_slowdown": 3}}).link
    assert link.host_slowdown == 3.0


@pytest.mark.parametrize("cuda", [True, False])
def test_engine_args_on_cuda_pin_triton_moe_and_reject_other_backends(monkeypatch, cuda):
    """On a GPU the offloaded layer needs vLLM's Triton fused-MoE kernel: 'auto' becomes
    'triton', another backend is one clear error. The CPU build is left alone."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from vllm_specexpert.config import SpecExpertUnsupportedError
    from vllm_specexpert.validate import prepare_engine_args

    monkeypatch.setattr(current_platform, "is_cpu", lambda: not cuda)
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: cuda)

    def args(backend):
        return SimpleNamespace(moe_backend=backend, enforce_eager=True, worker_extension_cls="")

    auto = args("auto")
    prepare_engine_args(auto)
    assert auto.moe_backend == ("triton" if cuda else "auto")
    if cuda:
        with pytest.raises(SpecExpertUnsupportedError, match="moe_backend='flashinfer_cutlass'"):
            prepare_engine_args(args("flashinfer_cutlass"))
    else:
        prepare_engine_args(args("flashinfer_cutlass"))


def test_cuda_graphs_stay_piecewise_around_the_offloaded_op():
    """The offloaded op must never be captured: it becomes a splitting op and full
    graphs are turned down to piecewise; without compilation, graphs are turned off;
    eager engines are left alone."""
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

    from vllm_specexpert.layers.final_tap import FINAL_HIDDEN_OP
    from vllm_specexpert.layers.routed_experts import ROUTED_EXPERTS_OP
    from vllm_specexpert.validate import keep_piecewise_cuda_graphs

    attention = "vllm::unified_attention_with_output"
    compiled = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        splitting_ops=[attention],
    )
    keep_piecewise_cuda_graphs(compiled)
    assert compiled.splitting_ops == [attention, ROUTED_EXPERTS_OP, FINAL_HIDDEN_OP]
    assert compiled.cudagraph_mode == CUDAGraphMode.PIECEWISE
    keep_piecewise_cuda_graphs(compiled)  # idempotent
    assert compiled.splitting_ops == [attention, ROUTED_EXPERTS_OP, FINAL_HIDDEN_OP]

    uncompiled = CompilationConfig(mode=CompilationMode.NONE, cudagraph_mode=CUDAGraphMode.FULL)
    keep_piecewise_cuda_graphs(uncompiled)
    assert uncompiled.cudagraph_mode == CUDAGraphMode.NONE

    eager = CompilationConfig(
        mode=CompilationMode.NONE, cudagraph_mode=CUDAGraphMode.NONE, splitting_ops=[]
    )
    keep_piecewise_cuda_graphs(eager)
    assert eager.splitting_ops == [] and eager.cudagraph_mode == CUDAGraphMode.NONE


def test_token_scheduler_settings():
    from types import SimpleNamespace

    from vllm_specexpert.schedule.token_scheduler import SCHEDULER_CLS
    from vllm_specexpert.validate import prepare_engine_args

    config = SpecExpertConfig.from_dict({"path_predictor": "/rpp", "token_scheduler": {}})
    assert (config.token_scheduler.group_size, config.token_scheduler.max_wait_steps) == (8, 4)
    assert SpecExpertConfig.from_dict({"token_scheduler": None}).token_scheduler is None
    bad = [
        ({"token_scheduler": {}}, "path_predictor"),
        (
            {"path_predictor": "/rpp", "token_scheduler": {"group_size": 0}},
            "token_scheduler.group_size",
        ),
        (
            {"path_predictor": "/rpp", "token_scheduler": {"max_wait_steps": 2.5}},
            "token_scheduler.max_wait_steps",
        ),
        ({"path_predictor": "/rpp", "token_scheduler": {"group": 4}}, "token_scheduler.group"),
        ({"path_predictor": "/rpp", "token_scheduler": []}, "token_scheduler"),
    ]
    for raw, field_name in bad:
        with pytest.raises(SpecExpertConfigError, match=f"field '{field_name}'"):
            SpecExpertConfig.from_dict(raw)

    args = SimpleNamespace(moe_backend="auto", worker_extension_cls="", scheduler_cls=None)
    prepare_engine_args(args, config)
    assert args.scheduler_cls == SCHEDULER_CLS
    taken = SimpleNamespace(moe_backend="auto", worker_extension_cls="", scheduler_cls="my.Sched")
    with pytest.raises(SpecExpertConfigError, match=r"field 'path_predictor'.*scheduler_cls"):
        prepare_engine_args(taken, config)


# Issue 13: no bad setting that passes start and then kills or hangs the engine.


@pytest.mark.parametrize(
    "text, field",
    [
        # D2: JSON's Infinity and NaN pass json.loads; they used to reach the link's clock.
        ('{"link": {"bandwidth_gbps": 1, "latency_us": Infinity}}', "link.latency_us"),
        ('{"link": {"bandwidth_gbps": 1, "host_slowdown": Infinity}}', "link.host_slowdown"),
        ('{"link": {"bandwidth_gbps": Infinity}}', "link.bandwidth_gbps"),
        ('{"budget": NaN}', "budget"),
        ('{"stats_interval_s": Infinity, "stats_path": "/tmp/s.json"}', "stats_interval_s"),
        # D2: a link so slow the first miss never finishes.
        ('{"link": {"bandwidth_gbps": 1e-12}}', "link.bandwidth_gbps"),
        ('{"link": {"bandwidth_gbps": 1, "latency_us": 1e12}}', "link.latency_us"),
        ('{"token_scheduler": {"group_size": 0}}', "token_scheduler.group_size"),
        (
            '{"exact_layers": [-1], "miss_policy": "speculate", "predictor": "router"}',
            "exact_layers",
        ),
    ],
)
def test_non_finite_and_unphysical_numbers_are_rejected(text, field):
    with pytest.raises(SpecExpertConfigError) as info:
        SpecExpertConfig.from_dict(json.loads(text))
    assert info.value.field_name == field
    assert "range is" in info.value.fix


@pytest.mark.parametrize(
    "raw, field, needs",
    [
        # D4: settings that do nothing under the chosen mode.
        ({"link": {"latency_us": 10}}, "link.latency_us", "bandwidth_gbps"),
        ({"admit_host_experts": True}, "admit_host_experts", "cpu, auto, auto_buddy or lowbit"),
        ({"buddy": {"alpha": 0.5}}, "buddy", "auto_buddy, buddy or random"),
        ({"exact_layers": [1]}, "exact_layers", "speculate"),
        ({"prefetch_filter": "all"}, "prefetch_filter", "predictor"),
        (
            {
                "miss_policy": "buddy",
                "calibration": "c",
                "buddy": {"tau": 0.3, "tau_percentile": 20},
            },
            "buddy.tau_percentile",
            "remove one",
        ),
        ({"plec_preload": "step"}, "plec_preload", "cache 'plec'"),
        ({"stats_interval_s": 1}, "stats_interval_s", "stats_path"),
        ({"lookahead": {"draft_cache": 0.5}}, "lookahead.draft_cache", "set disk"),
    ],
)
def test_a_setting_without_effect_is_an_error_naming_what_it_needs(raw, field, needs):
    with pytest.raises(SpecExpertConfigError) as info:
        SpecExpertConfig.from_dict(raw)
    assert info.value.field_name == field
    assert needs in str(info.value)


def test_defaults_given_explicitly_are_not_settings_without_effect():
    config = SpecExpertConfig.from_dict(
        {
            "admit_host_experts": False,
            "prefetch_filter": "cost",
            "buddy": {"alpha": 0.95},
            "link": {"latency_us": 0},
        }
    )
    assert config == SpecExpertConfig.from_dict({})
    assert SpecExpertConfig.from_dict({"lookahead": {"draft_cache": "auto"}}).lookahead


@pytest.mark.parametrize(
    "raw",
    [
        {"link": {"bandwidth_gbps": 10, "latency_us": 10}},
        {"miss_policy": "cpu", "admit_host_experts": True},
        {"miss_policy": "random", "buddy": {"tau": 0.0}},
        {
            "miss_policy": "speculate",
            "predictor": "router",
            "exact_layers": [1],
            "prefetch_filter": "all",
        },
        {"cache": "plec", "plec_preload": "step", "path_predictor": "p"},
        {"stats_path": "/tmp/s.json", "stats_interval_s": 1},
        {"lookahead": {"draft_cache": 0.5}, "disk": {"path": "/tmp/pack"}},
    ],
)
def test_the_same_settings_with_their_mode_are_accepted_and_kept(raw):
    """The settings the "no effect" rule refuses alone are taken, as given, with the mode
    that uses them (a rule that refused them here would fail this test)."""
    config = SpecExpertConfig.from_dict(raw).to_dict()
    for key, value in raw.items():
        if isinstance(value, dict):
            assert {k: config[key][k] for k in value} == value, key
        else:
            assert config[key] == (tuple(value) if isinstance(value, list) else value), key


def test_a_change_is_checked_alone():
    config = SpecExpertConfig.from_dict({"miss_policy": "cpu", "admit_host_experts": True})
    # Giving a setting with a mode where it does nothing is an error ...
    with pytest.raises(SpecExpertConfigError, match="'admit_host_experts'"):
        config.changed({"miss_policy": "fetch", "admit_host_experts": True})
    # ... and a kept setting the change does not touch stays.
    assert config.changed({"budget": 0.25}).admit_host_experts


def test_a_section_given_keeps_the_settings_read_at_start_it_does_not_name():
    from vllm_specexpert.config.switch import check_switch

    config = SpecExpertConfig.from_dict({"lookahead": {"k_max": 3, "k": 1}})
    changed = config.changed({"lookahead": {"k": 2}})
    assert (changed.lookahead.k, changed.lookahead.k_max) == (2, 3)
    check_switch(config, changed)  # (only k changed: a running engine can take it)
    assert config.changed({"lookahead": {}}).lookahead.k is None  # (the governor again)
    meshed = SpecExpertConfig.from_dict(
        {"mesh": {"peers": 3, "mode": "no_stop"}, "predictor": "router"}
    )
    remeshed = meshed.changed({"mesh": {"timeout_ms": 100}})
    assert (remeshed.mesh.peers, remeshed.mesh.mode) == (3, "sync")
    check_switch(meshed, remeshed)
    packed = SpecExpertConfig.from_dict({"disk": {"path": "/p", "queue_depth": 8}})
    ahead = packed.changed({"disk": {"read_ahead_rows": 6}})
    assert (ahead.disk.path, ahead.disk.queue_depth, ahead.disk.read_ahead_rows) == ("/p", 8, 6)
    check_switch(packed, ahead)  # (the split is made again at every rebuild)
    with pytest.raises(SpecExpertConfigError, match=r"only disk\.read_ahead_rows") as refused:
        check_switch(packed, packed.changed({"disk": {"queue_depth": 2}}))
    assert refused.value.field_name == "disk"
    # Other settings of a section given take their defaults, as before.
    linked = SpecExpertConfig.from_dict({"link": {"bandwidth_gbps": 10, "latency_us": 5}})
    assert linked.changed({"link": {"bandwidth_gbps": 20}}).link.latency_us == 0


@pytest.mark.parametrize(
    "start, change, reset",
    [
        # Issue 22 (6): settings kept from before that stop having an effect used to stay,
        # so that the running config (get_stats()["config"]) no longer started an engine.
        (
            {"cache": "plec", "plec_preload": "next", "path_predictor": "p"},
            {"cache": "lru"},
            {"plec_preload": "none"},
        ),
        (
            {"miss_policy": "cpu", "admit_host_experts": True},
            {"miss_policy": "fetch"},
            {"admit_host_experts": False},
        ),
        (
            {"miss_policy": "buddy", "calibration": "c", "buddy": {"rho": 2, "beta": 0.5}},
            {"miss_policy": "fetch"},
            {"buddy": {"rho": 1, "beta": 0.75}},
        ),
        (
            {
                "miss_policy": "speculate",
                "predictor": "router",
                "exact_layers": [1],
                "prefetch_filter": "all",
            },
            {"miss_policy": "fetch", "predictor": "none"},
            {"exact_layers": None, "prefetch_filter": "cost"},
        ),
        # An approximate start's own budget is no reason to refuse a switch to an exact
        # mode: it goes back to the default budget, which waits for the next approximate
        # mode (issue 73: it used to go to null, and the next approximate mode ran
        # without a budget).
        (
            {"miss_policy": "drop", "quality": {"max_accuracy_loss": 0.05}},
            {"miss_policy": "fetch"},
            {"quality": {"max_accuracy_loss": 0.02}},
        ),
    ],
)
def test_a_change_resets_kept_settings_it_leaves_without_effect(start, change, reset):
    config = SpecExpertConfig.from_dict(start).changed(change)
    for key, value in reset.items():
        got = getattr(config, key)
        if isinstance(value, dict):
            got = {k: getattr(got, k) for k in value}
        assert got == value, key
    # What reconfigure returns starts an engine as it is.
    assert SpecExpertConfig.from_dict(config.to_dict()) == config


def test_null_specexpert_is_an_error_not_the_defaults():
    """D4: ``{"specexpert": null}`` used to turn the plugin on with defaults."""
    with pytest.raises(SpecExpertConfigError, match="JSON object"):
        SpecExpertConfig.from_additional_config({"specexpert": None})


def test_a_huge_budget_is_reported_briefly():
    """D5: the error used to print a 300-digit integer."""
    with pytest.raises(SpecExpertConfigError) as info:
        SpecExpertConfig.from_dict({"budget": 1e300})
    assert "1e+300" in str(info.value) and len(str(info.value)) < 200


@pytest.mark.parametrize(
    "budget, shown",
    [
        ("1" + "0" * 400 + "GB", "(403 characters) is larger than any memory"),
        ("5000000TB", "'5000000TB' is larger than any memory"),
        (10**400, "got an integer of 401 digits"),
        ("x" * 500, "(500 characters) is not a size"),
    ],
)
def test_a_budget_too_large_for_any_memory_is_one_short_error(budget, shown):
    with pytest.raises(SpecExpertConfigError) as info:
        SpecExpertConfig.from_dict({"budget": budget})
    assert info.value.field_name == "budget" and shown in info.value.problem
    assert len(str(info.value)) < 300


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"budget": 10**400}, "budget"),
        ({"budget": "1" + "0" * 400 + "GB"}, "budget"),
        ({"link": {"latency_us": 10**400}}, "link.latency_us"),
        ({"quality": {"seed": 2**70}}, "quality.seed"),
        ({"quality": {"batch_classes": [1, 2**70]}}, "quality.batch_classes"),
        ({"not_a_key": 2**64}, "not_a_key"),
        ({"stats_interval_s": -1}, "stats_interval_s"),
        ({"disk": {"path": "/p", "queue_depth": "4"}}, "disk.queue_depth"),
        # (a section without the settings read at start keeps the running ones: only
        # what it names is checked)
        ({"disk": {"read_ahead_rows": -1}}, "disk.read_ahead_rows"),
    ],
)
def test_reconfigures_values_are_checked_before_they_are_sent(changes, field):
    # (a 401-digit integer used to reach msgpack and raise its OverflowError)
    with pytest.raises(SpecExpertConfigError) as info:
        SpecExpertConfig.check_changes(changes)
    assert info.value.field_name == field


def test_what_reconfigure_cannot_send_is_refused_at_start_too():
    # Issue 73 (4): quality.seed 2**70 started an engine that reconfigure then refused.
    raw = {"miss_policy": "drop", "quality": {"seed": 2**70}}
    with pytest.raises(SpecExpertConfigError) as info:
        SpecExpertConfig.from_additional_config({"specexpert": raw})
    assert info.value.field_name == "quality.seed" and "64 bits" in info.value.problem
    with pytest.raises(SpecExpertConfigError) as info:
        SpecExpertConfig.check_changes(raw)
    assert info.value.field_name == "quality.seed"
    SpecExpertConfig.from_dict({**raw, "quality": {"seed": 2**63}})  # (64 bits: sent)


def test_what_depends_on_the_other_settings_is_left_to_the_workers():
    # buddy needs a calibration the running config may have: not refused alone.
    SpecExpertConfig.check_changes({"miss_policy": "buddy", "budget": 0.5, "disk": None})


@pytest.mark.parametrize(
    "raw, shown",
    [
        # Issue 22 (6): 8.0 was shown as "8" (where a count is wanted, the float is the fault).
        ({"token_scheduler": {"group_size": 8.0}, "path_predictor": "p"}, "got 8.0"),
        ({"buddy": {"rho": 2.0}, "miss_policy": "buddy", "calibration": "c"}, "got 2.0"),
    ],
)
def test_a_rejected_value_is_shown_as_given(raw, shown):
    with pytest.raises(SpecExpertConfigError) as info:
        SpecExpertConfig.from_dict(raw)
    assert info.value.problem.endswith(shown)


@pytest.mark.parametrize("budget", [0, -3, 70000])
def test_the_budget_count_range_is_the_same_in_problem_and_fix(budget):
    # Issue 22 (6): budget 0 said "count must be in [1, 65536]", its fix "[2, 65536]".
    with pytest.raises(SpecExpertConfigError) as info:
        SpecExpertConfig.from_dict({"budget": budget})
    assert "[2, 65536]" in info.value.problem and "[2, 65536]" in info.value.fix


def test_each_mode_table_has_one_class_per_name_and_the_class_takes_its_traits_from_it():
    """Config validation reads the modes' traits (``config/modes.py``), the engine looks
    the classes up by the same names: one registry pattern for the three kinds."""
    from vllm_specexpert.config.modes import CACHES, MISS_POLICIES, PREDICTORS
    from vllm_specexpert.features import miss_policy_classes
    from vllm_specexpert.predict import PREDICTOR_CLASSES
    from vllm_specexpert.tiers.eviction import CACHE_CLASSES

    for specs, classes in ((MISS_POLICIES, miss_policy_classes()), (CACHES, CACHE_CLASSES)):
        assert list(classes) == list(specs)
        assert all(cls.spec is specs[name] for name, cls in classes.items())
    assert list(PREDICTOR_CLASSES) == list(PREDICTORS)
    assert [name for name, cls in PREDICTOR_CLASSES.items() if cls is None] == [
        name for name, spec in PREDICTORS.items() if not spec.predicts
    ]
    assert all(cls.name == name for name, cls in PREDICTOR_CLASSES.items() if cls)


@pytest.mark.parametrize(
    ("raw", "budget", "warns"),
    [
        ({"miss_policy": "speculate", "predictor": "router"}, 0.02, None),
        ({"miss_policy": "drop"}, 0.02, None),
        ({"miss_policy": "drop", "quality": None}, None, "quality is null"),
        ({"miss_policy": "drop", "quality": {"max_accuracy_loss": 0.05}}, 0.05, None),
        ({"miss_policy": "fetch"}, 0.02, None),  # (waits for an approximate mode)
        ({"miss_policy": "fetch", "quality": None}, None, None),  # (exact: nothing to warn of)
        ({"mesh": {"mode": "no_stop"}, "predictor": "router"}, 0.02, None),
        (
            {"mesh": {"mode": "no_stop"}, "predictor": "router", "quality": None},
            None,
            "mesh mode 'no_stop' changes the output",
        ),
    ],
)
def test_every_engine_has_the_default_quality_budget_unless_it_is_null(raw, budget, warns):
    config = SpecExpertConfig.from_additional_config({"specexpert": raw})
    got = config.quality.max_accuracy_loss if config.quality is not None else None
    assert got == budget  # (0.02: the 98 % of exact accuracy the approximate modes promise)
    if warns is None:
        assert config.unbudgeted is None
    else:
        assert warns in config.unbudgeted
    # What reconfigure builds (from_dict) is the same config: one place adds the default.
    assert SpecExpertConfig.from_dict(raw) == config


APPROXIMATE = {
    "speculate": {"predictor": "router"},
    "buddy": {"calibration": "c"},
    "auto_buddy": {"calibration": "c"},
    "random": {"calibration": "c"},
    "drop": {},
    "lowbit": {},
}
"""Each approximate miss policy with what it needs beside it."""
NOT_APPROXIMATE = ["fetch", "stream", "cpu", "auto"]


def test_the_approximate_policies_are_all_here():
    # (a policy added to the registry and not here would go untested below)
    approximate = {n for n, spec in MISS_POLICIES.items() if spec.output == "approximate"}
    assert approximate == set(APPROXIMATE)
    assert set(MISS_POLICIES) - approximate == set(NOT_APPROXIMATE)


@pytest.mark.parametrize("other", NOT_APPROXIMATE)
@pytest.mark.parametrize("policy", list(APPROXIMATE))
def test_the_quality_budget_holds_through_every_other_mode_and_back(policy, other):
    """Issue 73 (1): an approximate mode reached by ``reconfigure`` from an exact or
    equivalent one, whichever was first, runs under the budget; null stays null."""
    needs = APPROXIMATE[policy]
    for start, first, then in (
        ({"miss_policy": policy, **needs}, {"miss_policy": other}, {"miss_policy": policy}),
        ({"miss_policy": other, **needs}, {"miss_policy": policy}, {"miss_policy": other}),
    ):
        config = SpecExpertConfig.from_additional_config({"specexpert": start})
        for change in (first, then, first, then):
            config = config.changed(change)
            assert config.quality == QualityConfig(), (start, change)
            assert config.unbudgeted is None
    nulled = SpecExpertConfig.from_additional_config(
        {"specexpert": {"miss_policy": policy, "quality": None, **needs}}
    )
    back = nulled.changed({"miss_policy": other}).changed({"miss_policy": policy})
    assert back.quality is None and "quality is null" in back.unbudgeted
    # and a budget given with the switch is the one it runs under
    given = nulled.changed({"miss_policy": other}).changed(
        {"miss_policy": policy, "quality": {"max_accuracy_loss": 0.01}}
    )
    assert given.quality == QualityConfig(max_accuracy_loss=0.01)
