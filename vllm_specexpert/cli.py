"""The ``specexpert`` command.

    specexpert demo                  # offloaded generation on the default model, vs vanilla
    specexpert mesh-demo             # experts on Ray peers behind a real delay (root)
    specexpert train-estimator [MODEL] --out DIR  # the neural expert estimator (q_l -> next logits)
    specexpert serve MODEL [ARGS]    # = vllm serve, usable on the CPU build of vLLM
    specexpert vllm SUBCOMMAND ...   # any vllm CLI subcommand (bench, serve, ...)
    specexpert corpus [--out F]      # this environment's Python corpus: files, splits
    specexpert train-tiny            # retrain the embedded default model (about 90 min, CPU)
    specexpert capture [MODEL] --out DIR   # per-token routing traces (router logits, r_l, s_l)
    specexpert calibrate [MODEL] --out DIR # default vectors, routing counts, co-activation
    specexpert analyze [MODEL] --calibration DIR --out DIR  # next-layer prediction quality
    specexpert train-path [MODEL] --out DIR   # the routing-path predictor (ExpertFlow RPP)
    specexpert eval-path [MODEL] --path-predictor DIR  # its batch-level accuracy
    specexpert quantize MODEL OUT --format F  # a bf16 checkpoint's experts quantized
    specexpert dequantize MODEL OUT           # a quantized checkpoint's bf16 twin

A tool checks its arguments before any work (:mod:`vllm_specexpert.tools.arguments`): a
bad one, or a configuration error the tool finds, is one ``error:`` line, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from vllm_specexpert import vllm_hooks


def take_plugins_flag(argv: list[str]) -> list[str]:
    """``argv`` without ``--plugins NAME[,NAME...]`` (also ``--plugins a b`` and
    ``--plugins=a,b``), whose names go to ``VLLM_PLUGINS``. Done here, before vLLM
    loads its plugins: the flag is the plugin's own, so vLLM's parser would not know it
    when ``VLLM_PLUGINS`` leaves the plugin out. Unknown names are a ``ValueError``."""
    from vllm_specexpert.validate import plugin_names

    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--plugins" or arg.startswith("--plugins="):
            i += 1
            values = [arg.partition("=")[2]] if "=" in arg else []
            while arg == "--plugins" and i < len(argv) and not argv[i].startswith("-"):
                values.append(argv[i])  # nargs="+", as the plugin's own flag
                i += 1
            try:
                os.environ["VLLM_PLUGINS"] = ",".join(plugin_names(values))
            except ValueError as error:
                raise ValueError(f"--plugins: {error}") from None
            continue
        rest.append(arg)
        i += 1
    return rest


def configures_plugin(argv: list[str]) -> bool:
    """Whether vLLM's arguments ``argv`` set ``additional_config["specexpert"]``:
    ``--additional-config JSON`` (or ``=JSON``, or ``_``), the dotted form
    ``--additional-config.specexpert.budget 0.5``, or a ``--config`` YAML file."""
    from vllm_specexpert.config import ADDITIONAL_CONFIG_KEY as KEY

    def has_key(value: object) -> bool:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return False
        return isinstance(value, dict) and KEY in value

    for i, arg in enumerate(argv):
        name, _, inline = arg.partition("=")
        name = name.replace("_", "-")
        value = inline if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
        if name == "--additional-config" and has_key(value):
            return True
        if name.startswith(f"--additional-config.{KEY}"):
            return True
        if name == "--config" and value:
            import yaml

            try:
                with open(value) as f:
                    loaded = yaml.safe_load(f)
            except (OSError, yaml.YAMLError):
                continue  # vLLM reports it
            if isinstance(loaded, dict) and any(
                has_key(loaded.get(k)) for k in ("additional-config", "additional_config")
            ):
                return True
    return False


def run_vllm_cli(argv: list[str]) -> None:
    """Run vLLM's own CLI with ``argv`` (e.g. ``["serve", MODEL, ...]``), after
    taking ``--plugins`` and checking that a ``specexpert`` config will reach the plugin."""
    try:
        argv = take_plugins_flag(argv)
        if configures_plugin(argv):
            from vllm_specexpert.validate import check_plugin_enabled

            check_plugin_enabled("every vLLM process")
        else:  # (an engine the plugin configures gets its KV cache sized by the plugin)
            vllm_hooks.set_cpu_defaults()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    vllm_hooks.patch_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    from vllm_specexpert.config import SpecExpertConfigError, SpecExpertUnsupportedError

    sys.argv = ["vllm", *argv]
    try:
        vllm_main()
    except (SpecExpertConfigError, SpecExpertUnsupportedError) as error:
        # A configuration mistake: one line, no traceback.
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["vllm"]:
        return run_vllm_cli(argv[1:])
    if argv[:1] == ["serve"]:
        return run_vllm_cli(argv)

    parser = argparse.ArgumentParser(prog="specexpert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="vllm serve MODEL ... (works on the CPU build)")
    sub.add_parser("vllm", help="any vllm CLI subcommand, e.g. `specexpert vllm bench ...`")

    # Tools load only here: `specexpert serve` and the plugin never import them.
    from vllm_specexpert.tools import (
        analyze,
        calibrate,
        capture,
        composition,
        corpus,
        demo,
        dequantize,
        eval_path,
        mesh_demo,
        pack,
        quantize,
        train_estimator,
        train_path,
        train_tiny,
        widen,
    )

    tools = {
        "demo": demo,
        "corpus": corpus,
        "train-tiny": train_tiny,
        "capture": capture,
        "calibrate": calibrate,
        "analyze": analyze,
        "train-path": train_path,
        "eval-path": eval_path,
        "quantize": quantize,
        "dequantize": dequantize,
        "mesh-demo": mesh_demo,
        "train-estimator": train_estimator,
        "composition": composition,
        "pack": pack,
        "widen": widen,
    }
    from vllm_specexpert.config import SpecExpertConfigError, SpecExpertUnsupportedError
    from vllm_specexpert.tools.arguments import UsageError

    parsers = {}
    for name, module in tools.items():
        parsers[name] = sub.add_parser(name, help=(module.__doc__ or name).split("\n")[0])
        module.add_arguments(parsers[name])

    args = parser.parse_args(argv)
    tool = parsers[args.command]
    try:
        tools[args.command].run(args)
    except UsageError as error:  # an argument checked after parsing, before any work
        tool.error(str(error))
    except (SpecExpertConfigError, SpecExpertUnsupportedError) as error:
        # The user's mistake found by the tool's own code: one line, no traceback.
        print(f"{tool.prog}: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
