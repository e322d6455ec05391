"""The plugin is inert without its config key, and bad settings fail at engine start
with one clear error, in the calling process, before any engine process starts."""

import pytest
from vllm_harness import make_llm, submit_greedy_in_other_process

from vllm_specexpert import SpecExpertConfigError, SpecExpertUnsupportedError

VANILLA_CLASS = "vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts"
VANILLA_MODEL = "vllm.model_executor.models.qwen3_moe.Qwen3MoeForCausalLM"
OFFLOADED_CLASS = "vllm_specexpert.layers.routed_experts.OffloadedRoutedExperts"


@pytest.mark.parametrize(
    "arch, classes, model",
    [
        ("qwen3_moe", [VANILLA_CLASS], VANILLA_MODEL),
        # A model's own RoutedExperts subclass: its offloaded variant turns back into it.
        (
            "gpt_oss",
            ["vllm.model_executor.models.gpt_oss.GptOssRoutedExperts"],
            "vllm.model_executor.models.gpt_oss.GptOssForCausalLM",
        ),
    ],
)
def test_without_the_key_vllm_is_untouched(arch, classes, model):
    # (two processes, one per plugins setting: they run side by side)
    without = submit_greedy_in_other_process(arch, plugins=False)
    loaded = submit_greedy_in_other_process(arch, plugins=True).result()  # no "specexpert"
    reference = without.result()
    assert reference["expert_layer_classes"] == classes
    assert loaded["expert_layer_classes"] == classes
    assert loaded["model_class"] == reference["model_class"] == model
    ref, out = reference["completions"], loaded["completions"]
    assert [c.token_ids for c in out] == [c.token_ids for c in ref]
    assert [c.logprobs for c in out] == [c.logprobs for c in ref]


def kernel_isas(model) -> list[str]:
    """Worker side: the ISA of the CPU kernel each offloaded layer calls."""
    from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts

    return sorted(
        {
            m.slot_kernel.direct_experts().isa
            for m in model.modules()
            if isinstance(m, OffloadedRoutedExperts)
        }
    )


def test_with_the_key_the_layer_is_offloaded_and_sized_from_the_machine():
    from moe_reference import vllm_isa
    from vllm_harness import expert_layer_classes, greedy, model_class, shutdown

    import vllm_specexpert

    llm = make_llm("qwen3_moe", specexpert={})  # the defaults: budget auto
    try:
        assert llm.apply_model(expert_layer_classes) == [[OFFLOADED_CLASS]]
        assert llm.apply_model(model_class) == [
            "vllm_specexpert.layers.model_classes.Qwen3MoeForCausalLM"
        ]
        # The kernel exactness tests run the ISA the offloaded layers run.
        assert llm.apply_model(kernel_isas) == [[vllm_isa()]]
        # The fixture's experts (a few MB) fit this machine's free RAM: all resident,
        # and the start line says so and why.
        greedy(llm)
        stats = vllm_specexpert.get_stats(llm)[0]
        assert stats["slots_per_layer"] == stats["experts_per_layer"]
        assert stats["decode_tokens"] > 0 and stats["total"]["decode"]["misses"] == 0
        assert stats["config"]["budget"] == "auto"  # as given
        assert "(budget auto: " in stats["summary"] and "every expert fits" in stats["summary"]
    finally:
        shutdown(llm)


@pytest.mark.parametrize(
    "specexpert, error, field",
    [
        ({"budget": 0.1}, SpecExpertConfigError, "budget"),  # 1 slot < top_k=4
        ({"budget": 17}, SpecExpertConfigError, "budget"),  # more than 16 experts
        ({"cache": "fifo"}, SpecExpertConfigError, "cache"),
        ({"bugdet": 0.5}, SpecExpertConfigError, "bugdet"),
        ({"link": {"bandwidth_gbps": -1}}, SpecExpertConfigError, "link.bandwidth_gbps"),
    ],
)
def test_bad_config_fails_before_the_engine_starts(specexpert, error, field):
    with pytest.raises(error) as info:
        make_llm("qwen3_moe", specexpert=specexpert)
    assert f"field '{field}'" in str(info.value) and "Fix:" in str(info.value)


def test_budget_error_gives_the_minimum():
    with pytest.raises(SpecExpertConfigError, match=r"top_k=4.*budget >= 4 or >= 0\.25"):
        make_llm("qwen3_moe", specexpert={"budget": 0.2})


def test_dense_model_is_rejected():
    with pytest.raises(SpecExpertUnsupportedError, match="Qwen3ForCausalLM"):
        make_llm("qwen3_dense", specexpert={"budget": 0.5})


@pytest.fixture
def serve_parser(monkeypatch):
    """vLLM's own ``vllm serve`` argument parser (the same on the CUDA build; on CPU
    ``specexpert serve`` runs vLLM's CLI with it), with VLLM_PLUGINS restored after."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    return make_arg_parser(FlexibleArgumentParser())


def test_plugins_flag_parses_and_sets_vllm_plugins(serve_parser):
    import os

    args = serve_parser.parse_args(
        ["--plugins", "specexpert", "--model", "m", "--additional-config", '{"specexpert": {}}']
    )
    assert args.plugins == ["specexpert"]
    assert os.environ["VLLM_PLUGINS"] == "specexpert"
    assert args.additional_config == {"specexpert": {}}


def test_plugins_flag_rejects_an_unknown_plugin(serve_parser, capsys):
    import os

    with pytest.raises(SystemExit) as info:
        serve_parser.parse_args(["--plugins", "specexpert,spec_expert"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--plugins: unknown plugin spec_expert" in err and "specexpert" in err
    assert "VLLM_PLUGINS" not in os.environ


def test_a_config_for_a_plugin_left_out_is_an_error(monkeypatch):
    """``--plugins other --additional-config '{"specexpert": ...}'`` would silently run
    vanilla: the engine processes would not load the plugin."""
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    with pytest.raises(SpecExpertConfigError, match="leaves it out of the engine processes"):
        make_llm("qwen3_moe", specexpert={"budget": 0.5})


# Issue 22 (3): with VLLM_PLUGINS leaving the plugin out, no vLLM process loads it and
# its config used to be ignored silently (vanilla served). `specexpert serve` / `specexpert
# vllm` see the arguments before vLLM does, and take --plugins themselves.

SPECEXPERT_CONFIG = ["--additional-config", '{"specexpert": {"budget": 0.5}}']


@pytest.mark.parametrize(
    "env, args",
    [
        ({"VLLM_PLUGINS": "lora_filesystem_resolver"}, SPECEXPERT_CONFIG),
        ({"VLLM_PLUGINS": ""}, SPECEXPERT_CONFIG),
        # The flag used to fail as vLLM's "unrecognized arguments: --plugins", not naming
        # VLLM_PLUGINS or the config.
        ({}, ["--plugins", "lora_filesystem_resolver", *SPECEXPERT_CONFIG]),
        (
            {},
            ["--plugins=lora_filesystem_resolver", "--additional-config.specexpert.budget", "0.5"],
        ),
    ],
)
def test_specexpert_serve_refuses_a_config_the_plugin_would_never_see(env, args, tmp_path):
    import os
    import subprocess

    from vllm_specexpert.tools.server import SPECEXPERT

    proc = subprocess.run(
        [*SPECEXPERT, "serve", str(tmp_path / "model"), *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "field 'specexpert'" in lines[0] and "VLLM_PLUGINS=" in lines[0]
    assert "add specexpert to --plugins" in lines[0]


def test_the_cli_takes_plugins_before_vllm_loads_them(monkeypatch):
    import os

    from vllm_specexpert.cli import take_plugins_flag

    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    rest = take_plugins_flag(
        ["serve", "m", "--plugins", "specexpert", "lora_hf_hub_resolver", "--port", "1"]
    )
    assert rest == ["serve", "m", "--port", "1"]
    assert os.environ["VLLM_PLUGINS"] == "specexpert,lora_hf_hub_resolver"
    assert take_plugins_flag(["--plugins=specexpert", "x"]) == ["x"]
    assert os.environ["VLLM_PLUGINS"] == "specexpert"
    with pytest.raises(ValueError, match="--plugins: unknown plugin nope"):
        take_plugins_flag(["--plugins", "nope"])
    with pytest.raises(ValueError, match=r"unknown plugin \(none\)"):
        take_plugins_flag(["--plugins", "--port", "1"])


@pytest.mark.parametrize(
    "args, configured",
    [
        (["--additional-config", '{"specexpert": {}}'], True),
        (['--additional_config={"specexpert": {"budget": 0.5}}'], True),
        (["--additional-config.specexpert.budget", "0.5"], True),
        (["--additional-config", '{"other": {}}'], False),
        (["--additional-config", "not json"], False),
        (["--port", "1"], False),
    ],
)
def test_the_cli_sees_a_specexpert_config_in_each_form_vllm_accepts(args, configured):
    from vllm_specexpert.cli import configures_plugin

    assert configures_plugin(["serve", "m", *args]) is configured


def test_the_cli_sees_a_specexpert_config_in_a_config_file(tmp_path):
    from vllm_specexpert.cli import configures_plugin

    config = tmp_path / "serve.yaml"
    config.write_text('port: 8000\nadditional-config: \'{"specexpert": {"budget": 0.5}}\'\n')
    assert configures_plugin(["serve", "m", "--config", str(config)])
    config.write_text("port: 8000\n")
    assert not configures_plugin(["serve", "m", "--config", str(config)])


def test_get_stats_of_an_llm_without_the_plugin_says_why(monkeypatch):
    """An ``LLM`` built while VLLM_PLUGINS left the plugin out runs vanilla; asking it for
    the plugin's stats names the cause instead of a worker's AttributeError."""
    from types import SimpleNamespace

    import vllm_specexpert

    def llm(additional_config, extension=""):
        config = SimpleNamespace(
            additional_config=additional_config,
            parallel_config=SimpleNamespace(worker_extension_cls=extension),
        )
        return SimpleNamespace(
            llm_engine=SimpleNamespace(vllm_config=config),
            collective_rpc=lambda *a, **k: pytest.fail("RPC was sent"),
        )

    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    with pytest.raises(RuntimeError, match="VLLM_PLUGINS='lora_filesystem_resolver'"):
        vllm_specexpert.get_stats(llm({"specexpert": {}}))
    with pytest.raises(RuntimeError, match="no 'specexpert' key"):
        vllm_specexpert.reset_stats(llm({}))
    monkeypatch.delenv("VLLM_PLUGINS")
    with pytest.raises(RuntimeError, match=r"worker_extension_cls='my\.Ext'"):
        vllm_specexpert.reconfigure(llm({"specexpert": {}}, "my.Ext"), budget=0.5)
