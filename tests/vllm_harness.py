"""Start and stop vLLM engines for end-to-end tests, and run greedy generation."""

from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from specexpert_testbed.fixtures import model_path
from vllm_specexpert.tools.harness import start_engine
from vllm_specexpert.tools.harness import stop_engine as shutdown

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
    prompt_logprobs: list[dict[int, float]] | None = None
    """Top-5 logprobs per prompt position (from the second), when asked for."""


def make_llm(arch: str, specexpert: dict, eager: bool = True, **kwargs):
    """A plugin engine in this process (in-process engine core, see conftest)."""
    return start_engine(str(model_path(arch)), specexpert, eager=eager, max_model_len=512, **kwargs)


def expert_layer_classes(model) -> list[str]:
    """Worker side: the classes of the model's routed-expert layers."""
    return sorted(
        {
            f"{type(m).__module__}.{type(m).__qualname__}"
            for m in model.modules()
            if type(m).__name__.endswith("RoutedExperts")
        }
    )


def model_class(model) -> str:
    """Worker side: the model's class."""
    return f"{type(model).__module__}.{type(model).__qualname__}"


def greedy_in_other_process(
    arch: str,
    plugins: bool,
    eager: bool = True,
    prompts=PROMPTS,
    max_tokens: int = MAX_TOKENS,
    prompt_logprobs: bool = False,
    **engine_kwargs,
) -> dict:
    """Greedy completions of ``prompts`` from an engine with no ``specexpert`` config,
    started in a process other than the tests' (:class:`ReferenceProcess`); with
    ``plugins=False`` no vLLM plugin is ever loaded there. Engines of the test process
    share it with the plugin, so vanilla references come from here. Returns
    ``{"completions": [...], "expert_layer_classes": [...], "model_class": str}``."""
    return submit_greedy_in_other_process(
        arch, plugins, eager, prompts, max_tokens, prompt_logprobs, **engine_kwargs
    ).result()


def submit_greedy_in_other_process(
    arch: str,
    plugins: bool,
    eager: bool = True,
    prompts=PROMPTS,
    max_tokens: int = MAX_TOKENS,
    prompt_logprobs: bool = False,
    **engine_kwargs,
) -> PendingRun:
    """:func:`greedy_in_other_process`, started: its result is awaited later, so that
    the other process runs while this one starts its own engines. The model is built
    here first, so that no two processes write it."""
    model_path(arch)
    request = {
        "arch": arch,
        "eager": eager,
        "prompts": list(prompts),
        "max_tokens": max_tokens,
        "prompt_logprobs": prompt_logprobs,
        "engine": engine_kwargs,
    }
    return ReferenceProcess.of(plugins).submit(request, _with_completions)


def _with_completions(result: dict) -> dict:
    result["completions"] = [
        Completion(
            c["token_ids"],
            _int_keys(c["logprobs"]),
            _int_keys(c["prompt_logprobs"]) if c["prompt_logprobs"] else None,
        )
        for c in result["completions"]
    ]
    return result


class PendingRun:
    """One request to a :class:`ReferenceProcess`, answered in the order sent."""

    def __init__(self, process: ReferenceProcess, out: str, then) -> None:
        self.process = process
        self.out = out
        self.then = then
        self.error: str | None = None
        self.answered = False
        self._result: dict | None = None

    def result(self) -> dict:
        while not self.answered:
            self.process.read_answer()
        assert self.error is None, self.error
        if self._result is None:
            with open(self.out) as f:
                self._result = self.then(json.load(f))
            os.unlink(self.out)
        return self._result


class ReferenceProcess:
    """A Python process of its own that starts the engines of
    :func:`greedy_in_other_process` one after another and stops each after its run: vLLM's
    imports (about 12 s on 2 cores) are paid once per test session, not once per
    reference. One per ``plugins`` setting, kept until the session ends; its output goes
    to a log file, its answers to a pipe of their own."""

    _running: ClassVar[dict[bool, ReferenceProcess]] = {}

    @classmethod
    def of(cls, plugins: bool) -> ReferenceProcess:
        process = cls._running.get(plugins)
        if process is None or process.child.poll() is not None:
            process = cls._running[plugins] = cls(plugins)
        return process

    def __init__(self, plugins: bool) -> None:
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if not plugins:
            env["VLLM_PLUGINS"] = ""
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - the child's, for its life
            "w+", prefix="specexpert-reference-", suffix=".log"
        )
        answers, self._answer_fd = os.pipe()
        self.child = subprocess.Popen(
            [sys.executable, __file__, str(self._answer_fd)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            pass_fds=[self._answer_fd],
        )
        os.close(self._answer_fd)
        self.answers = os.fdopen(answers)
        self.outputs = tempfile.TemporaryDirectory(prefix="specexpert-references-")
        self.sent = 0
        self.pending: collections.deque[PendingRun] = collections.deque()
        atexit.register(self.close)

    def submit(self, request: dict, then=lambda result: result) -> PendingRun:
        """Send ``request``; the answer, read when awaited, goes through ``then``."""
        assert self.child.stdin is not None
        self.sent += 1
        out = os.path.join(self.outputs.name, f"{self.sent}.json")
        self.child.stdin.write(json.dumps({**request, "out": out}) + "\n")
        self.child.stdin.flush()
        pending = PendingRun(self, out, then)
        self.pending.append(pending)
        return pending

    def read_answer(self) -> None:
        """The answer to the oldest request still unanswered."""
        answer = self.answers.readline()
        if not answer:
            self.log.seek(0)
            raise AssertionError(f"the reference process died: {self.log.read()[-4000:]}")
        pending = self.pending.popleft()
        pending.error, pending.answered = json.loads(answer).get("error"), True

    def close(self) -> None:
        if self.child.poll() is None and self.child.stdin is not None:
            self.child.stdin.close()  # (end of input: it exits)
            try:
                self.child.wait(60)
            except subprocess.TimeoutExpired:
                self.child.kill()


def _int_keys(steps):
    return [{int(t): lp for t, lp in step.items()} for step in steps]


_VANILLA: dict[tuple, PendingRun] = {}


def vanilla_reference(arch: str, eager: bool = True, **engine) -> tuple[Completion, ...]:
    """Vanilla vLLM's greedy completions of PROMPTS, computed once per test session, by
    an engine with the ``engine`` settings of the engine it is compared with: where the
    scheduling differs (``max_num_batched_tokens``), so do the batches, and on a CPU
    with AMX a GEMM's result depends on the batch it is in."""
    return tuple(vanilla_reference_ahead(arch, eager, **engine).result()["completions"])


def vanilla_reference_ahead(arch: str, eager: bool = True, **engine) -> PendingRun:
    """:func:`vanilla_reference`, started (once) in the other process: a module that
    knows its next model asks for it before it starts its own engine on this one."""
    key = (arch, eager, tuple(sorted(engine.items())))
    if key not in _VANILLA:
        _VANILLA[key] = submit_greedy_in_other_process(arch, False, eager, **engine)
    return _VANILLA[key]


def following_param(request):
    """The param of ``request``'s module-scoped, parametrized fixture that the selected
    tests take next, or ``None``: its setup may start that one's vanilla reference
    ahead."""
    seen = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if item.module is request.module and callspec and request.fixturename in callspec.params:
            param = callspec.params[request.fixturename]
            if param not in seen:
                seen.append(param)
    at = seen.index(request.param) if request.param in seen else len(seen)
    return seen[at + 1] if at + 1 < len(seen) else None


def skip_unless_batch_invariant(claim: str, logprobs: bool = False) -> None:
    """Skip the rest of the calling test, with ``claim`` and the reason as the printed
    skip reason (``-rs``), on a CPU with AMX: there vLLM's CPU GEMMs round a pass of
    several tokens per sequence (a speculative-decoding verification pass) otherwise
    than one-token passes (issue 46: lookahead flipped a near-tie at token 46 of 48 in 1
    of 4 sequences), so a claim that compares the two holds only on a CPU without AMX.
    ``logprobs``: a claim on logprobs, which hold only with vLLM's AVX512-BF16 build:
    its build for AVX-512 without BF16 (``_C_AVX512``) gave the same tokens and
    logprobs that differ in the 5th digit. Call it right before the one assertion that
    needs it."""
    import pytest
    import torch

    if torch.cpu._is_amx_tile_supported():
        pytest.skip(
            f"not asserted on this CPU: {claim}. It has AMX, where a verification pass of "
            "k tokens per sequence does not round like k one-token passes (issue 46)"
        )
    if logprobs and not torch.cpu._is_avx512_bf16_supported():
        pytest.skip(
            f"not asserted on this CPU: {claim}. It has no AVX512-BF16: vLLM runs its "
            f"{'_C_AVX512' if torch.cpu._is_avx512_supported() else '_C_AVX2'} kernels, "
            "whose k-token verification passes give the same tokens as one-token passes "
            "and logprobs that differ in the 5th digit (seen with _C_AVX512)"
        )


def greedy(
    llm, prompts=PROMPTS, max_tokens=MAX_TOKENS, prompt_logprobs: bool = False
) -> list[Completion]:
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        logprobs=5,
        ignore_eos=True,
        prompt_logprobs=5 if prompt_logprobs else None,
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for output in outputs:
        sample = output.outputs[0]
        prompt = None
        if prompt_logprobs:  # the first position has none
            prompt = [
                {t: lp.logprob for t, lp in step.items()} for step in output.prompt_logprobs[1:]
            ]
        result.append(
            Completion(
                token_ids=list(sample.token_ids),
                logprobs=[{t: lp.logprob for t, lp in step.items()} for step in sample.logprobs],
                prompt_logprobs=prompt,
            )
        )
    return result


def agreement(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> float:
    """Share of positions at which each token sequence of ``outputs`` equals its
    reference's; the sequences must be as many and as long as the reference's (a run cut
    short is an error, not a score)."""
    lengths = [len(o) for o in outputs], [len(r) for r in reference]
    assert lengths[0] == lengths[1], f"lengths {lengths[0]} against {lengths[1]}"
    pairs = [
        (a, b)
        for out, ref in zip(outputs, reference, strict=True)
        for a, b in zip(out, ref, strict=True)
    ]
    assert pairs, "nothing to compare"
    return sum(a == b for a, b in pairs) / len(pairs)


def token_ids(completions: Sequence[Completion]) -> list[list[int]]:
    """The generated tokens of each completion (what :func:`agreement` compares)."""
    return [c.token_ids for c in completions]


def cache_invariants(model) -> list[int]:
    """Worker side: wait for every copy in flight, then check the cache of every
    offloaded layer (``tests/invariants.py``). Returns the slots compared per layer."""
    from invariants import check_cache_invariants

    from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts

    return [
        check_cache_invariants(module.engine.layers[module.layer_name].loader, settle=True)
        for module in model.modules()
        if isinstance(module, OffloadedRoutedExperts)
    ]


def fix_host_cost(llm, per_expert: float, per_row: float = 0.0) -> None:
    """Fix every offloaded layer's host cost model (seconds per expert and per row) so
    that ``auto``'s host/link split is a function of the routing alone, not of how loaded
    the machine is (with :func:`fix_link_cost` for the link's side). Call it after
    :func:`vllm_specexpert.reconfigure`, which rebuilds the layers' places."""

    def fix(model) -> None:
        from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts

        for module in model.modules():
            if isinstance(module, OffloadedRoutedExperts):
                host = module.engine.layers[module.layer_name].places.get("host")
                if host is not None:  # a mode that computes on the host
                    host.host.cost.fix(per_expert, per_row)

    llm.apply_model(fix)


def fix_link_cost(llm, seconds_per_byte: float) -> None:
    """Fix the link time of one expert copy that ``auto``'s host/link split is made with
    (``MissContext.copy_seconds``): ``seconds_per_byte`` times each offloaded layer's
    expert bytes. An emulated link's estimate is its config's; without emulation it is
    what the layer's slow tier measured: a running mean of its real copies' times
    (demand loads and prefetches alike), starting from 1e-10 s per byte. Call it after
    :func:`vllm_specexpert.reconfigure`, which rebuilds the link and the miss contexts."""

    def fix(model) -> None:
        from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts

        for module in model.modules():
            if isinstance(module, OffloadedRoutedExperts):
                layer = module.engine.layers[module.layer_name]
                if layer.miss_context is not None:
                    seconds = seconds_per_byte * layer.experts.expert_nbytes
                    layer.miss_context.expert_copy_seconds = lambda s=seconds: s

    llm.apply_model(fix)


def _serve_references(answer_fd: int) -> None:
    """:class:`ReferenceProcess`'s side: a request a line on stdin, an answer a line on
    ``answer_fd`` (``{}``, or ``{"error": traceback}``) once its result is written."""
    import traceback

    from vllm import LLM

    with os.fdopen(answer_fd, "w") as answers:
        for line in sys.stdin:
            request = json.loads(line)
            try:
                llm = LLM(
                    model=str(model_path(request["arch"])),
                    dtype="bfloat16",
                    enforce_eager=request["eager"],
                    max_model_len=512,
                    seed=0,
                    **request["engine"],
                )
                try:
                    completions = greedy(
                        llm, request["prompts"], request["max_tokens"], request["prompt_logprobs"]
                    )
                    result = {
                        "completions": [dataclasses.asdict(c) for c in completions],
                        "expert_layer_classes": llm.apply_model(expert_layer_classes)[0],
                        "model_class": llm.apply_model(model_class)[0],
                    }
                finally:
                    shutdown(llm)
                with open(request["out"], "w") as f:
                    json.dump(result, f)
                answers.write("{}\n")
            except Exception:  # noqa: BLE001 - reported to the test, which fails with it
                answers.write(json.dumps({"error": traceback.format_exc()[-4000:]}) + "\n")
            answers.flush()


if __name__ == "__main__":  # the process of ReferenceProcess
    _serve_references(int(sys.argv[1]))
