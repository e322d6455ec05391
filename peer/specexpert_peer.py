"""A pytest plugin that points vLLM 0.32's own OpenAI-server tests at ``specexpert serve``.

Loaded with ``-p specexpert_peer`` by ``peer/run.py``; ``peer/vllm-0.32.0-openai.patch``
makes vLLM's ``RemoteVLLMServer`` call :func:`adapt` and :func:`serve_command`. The tests
name hub models (gpt2, Qwen3-0.6B, ...); there is no hub here, so every model the tests
name is served from one local directory under the name the test asked for, and a
tokenizer the test loads in its own process is that directory's tokenizer. That, the
context length, the server command and the plugin's flags are the whole adaptation.

Environment:
    SPECEXPERT_PEER_MODEL   the local model directory served for every hub name
    SPECEXPERT_PEER_CONFIG  JSON of the plugin's config; empty or unset = vanilla vLLM
    SPECEXPERT_PEER_MAX_LEN the model's context length (``--max-model-len`` is capped to it)
"""

from __future__ import annotations

import json
import os
import sys


def _model_dir() -> str:
    return os.environ["SPECEXPERT_PEER_MODEL"]


def _is_local(name: object) -> bool:
    return isinstance(name, (str, os.PathLike)) and os.path.isdir(name)


def serve_command() -> list[str]:
    """The server command that replaces ``vllm serve`` (it works on vLLM's CPU build)."""
    return [sys.executable, "-m", "vllm_specexpert.cli", "serve"]


def adapt(model: str, args: list[str]) -> tuple[str, list[str]]:
    """The local model and server arguments for a test that asked for ``model``."""
    args = list(args)
    if not _is_local(model) and "--served-model-name" not in args:
        args += ["--served-model-name", model]
    max_len = int(os.environ.get("SPECEXPERT_PEER_MAX_LEN", "1024"))
    for i, arg in enumerate(args[:-1]):
        if arg == "--max-model-len" and int(args[i + 1]) > max_len:
            args[i + 1] = str(max_len)
    config = os.environ.get("SPECEXPERT_PEER_CONFIG")
    if config:
        args += [
            "--plugins",
            "specexpert",
            "--additional-config",
            json.dumps({"specexpert": json.loads(config)}),
        ]
    return (model if _is_local(model) else _model_dir()), args


def pytest_configure(config) -> None:
    # The test process builds vLLM's serve parser and loads tokenizers itself: give it the
    # CPU build's environment, and map hub names to the local model for its tokenizers.
    from vllm_specexpert.vllm_hooks import patch_version_lookup, set_cpu_defaults

    set_cpu_defaults()
    patch_version_lookup()
    if os.environ.get("SPECEXPERT_PEER_CONFIG"):
        os.environ["VLLM_PLUGINS"] = "specexpert"  # so the parser knows --plugins

    import transformers
    import vllm.tokenizers

    get_tokenizer = vllm.tokenizers.get_tokenizer

    def local_get_tokenizer(tokenizer_name, *args, **kwargs):
        name = tokenizer_name if _is_local(tokenizer_name) else _model_dir()
        return get_tokenizer(name, *args, **kwargs)

    vllm.tokenizers.get_tokenizer = local_get_tokenizer
    auto_from_pretrained = transformers.AutoTokenizer.from_pretrained

    def local_from_pretrained(name, *args, **kwargs):
        return auto_from_pretrained(name if _is_local(name) else _model_dir(), *args, **kwargs)

    transformers.AutoTokenizer.from_pretrained = local_from_pretrained
