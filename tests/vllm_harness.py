"""Start and stop vLLM engines for end-to-end tests, and run greedy generation."""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass

from vllm_specexpert.fixtures import ensure_model

PROMPTS = [
    "def main():\n    ",
    "import os\nimport sys\n",
    "class Foo(object):",
    # Long enough that prefill needs more experts than any budget below 1.0 holds.
    "# Copyright (c) the authors. All rights reserved.\n"
    "from __future__ import annotations\n\nimport collections\nimport functools\n"
    "import itertools\n\n\ndef pairwise(iterable):\n    a, b = itertools.tee(iterable)\n"
    "    next(b, None)\n    return zip(a, b)\n",
]
MAX_TOKENS = 24


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    """Top-5 logprobs per generated token: equal floats mean an identical computation."""


@contextlib.contextmanager
def plugins_enabled(enabled: bool):
    """VLLM_PLUGINS="" keeps vLLM from loading any plugin in the engine processes."""
    saved = os.environ.get("VLLM_PLUGINS")
    if not enabled:
        os.environ["VLLM_PLUGINS"] = ""
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("VLLM_PLUGINS", None)
        else:
            os.environ["VLLM_PLUGINS"] = saved


def make_llm(arch: str, specexpert: dict | None = None, eager: bool = True,
             plugins: bool = True, **kwargs):
    from vllm import LLM

    from vllm_specexpert.plugins import register

    # vLLM loads plugins once per process: if the first engine of this test process was
    # a vanilla one (VLLM_PLUGINS=""), the main-process half of the plugin is missing.
    register()
    extra = {"additional_config": {"specexpert": specexpert}} if specexpert is not None else {}
    with plugins_enabled(plugins):
        return LLM(
            model=str(ensure_model(arch)), dtype="bfloat16", enforce_eager=eager,
            max_model_len=512, seed=0, **extra, **kwargs,
        )


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def greedy(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[Completion]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for output in outputs:
        sample = output.outputs[0]
        result.append(Completion(
            token_ids=list(sample.token_ids),
            logprobs=[{t: lp.logprob for t, lp in step.items()} for step in sample.logprobs],
        ))
    return result
