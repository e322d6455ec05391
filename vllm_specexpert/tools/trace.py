"""Run a transformers MoE model over documents and collect, per window of tokens and
per MoE layer, what the router saw and chose. Shared by ``capture`` (writes it to disk)
and ``calibrate`` (reduces it to default vectors and co-activation counts).

Works for the Hugging Face MoE layouts whose sparse block has a ``gate`` module returning
``(router_logits, topk_weights, topk_ids)`` and an ``experts`` module called as
``experts(hidden, topk_ids, topk_weights)`` (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE in
transformers 5).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class WindowTrace:
    """One forward pass (a window of one document) seen by every MoE layer."""

    document: str
    token_ids: torch.Tensor
    """``[T]``"""
    router_logits: torch.Tensor
    """``[T, L, E]`` float32"""
    topk_ids: torch.Tensor
    """``[T, L, K]`` int64"""
    topk_weights: torch.Tensor
    """``[T, L, K]`` float32, as passed to the experts"""
    residual: torch.Tensor
    """``[T, L, H]`` r_l, input of ``post_attention_layernorm``"""
    router_input: torch.Tensor
    """``[T, L, H]`` s_l, its output (the router's and experts' input)"""


class _LayerHooks:
    """Forward hooks that collect one forward pass's per-layer tensors."""

    def __init__(self, model):
        self.handles = []
        self.residual: dict[int, torch.Tensor] = {}
        self.router_input: dict[int, torch.Tensor] = {}
        self.router: dict[int, tuple] = {}
        layers = model.model.layers
        self.moe_layers = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "gate")]
        if not self.moe_layers:
            raise ValueError(f"{type(model).__name__}: no MoE layer with a `mlp.gate` router found")
        for i in self.moe_layers:
            layer = layers[i]
            self.handles.append(
                layer.post_attention_layernorm.register_forward_hook(self._norm_hook(i))
            )
            self.handles.append(layer.mlp.gate.register_forward_hook(self._gate_hook(i)))

    def _norm_hook(self, i: int):
        def hook(module, args, output):
            self.residual[i] = args[0].detach()
            self.router_input[i] = output.detach()

        return hook

    def _gate_hook(self, i: int):
        def hook(module, args, output):
            logits, weights, ids = output
            self.router[i] = (logits.detach(), weights.detach(), ids.detach())

        return hook

    def stacked(self, tokens: int) -> dict[str, torch.Tensor]:
        def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack([t.reshape(tokens, -1) for t in tensors], dim=1)

        layers = self.moe_layers
        return {
            "router_logits": stack([self.router[i][0] for i in layers]).float(),
            "topk_weights": stack([self.router[i][1] for i in layers]).float(),
            "topk_ids": stack([self.router[i][2] for i in layers]).long(),
            "residual": stack([self.residual[i] for i in layers]),
            "router_input": stack([self.router_input[i] for i in layers]),
        }

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def load_model(model_dir: str | Path):
    """A transformers model (fp32, eval) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model, tokenizer


def record_routes(
    model_dir: str | Path, prompts: list[str], max_tokens: int
) -> tuple[list, list[list[list[int]]]]:
    """``(routes, tokens)``: ``routes[i]`` is ``[max_tokens - 1, L, K]``, the experts of
    request ``i``'s decode steps (the token fed at each); ``tokens[i]`` its ids so far
    at each step (prompt + outputs), for the path predictor."""
    recorded = list(_greedy_routes(model_dir, prompts, max_tokens))
    return [steps for _, steps, _ in recorded], [contexts for _, _, contexts in recorded]


def record_prompt_routes(
    model_dir: str | Path, prompts: list[str], max_tokens: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per prompt, its pass's experts ``[P, L, K]`` (a token a row) and its greedy decode
    steps' ``[max_tokens - 1, L, K]`` (:func:`record_routes`)."""
    return [(prompt, steps) for prompt, steps, _ in _greedy_routes(model_dir, prompts, max_tokens)]


def _greedy_routes(model_dir: str | Path, prompts: list[str], max_tokens: int):
    """Per prompt, greedily decoded: its pass's routes, its decode steps' routes and ids
    so far at each step."""
    model, tokenizer = load_model(model_dir)
    hooks = _LayerHooks(model)
    try:
        for prompt in prompts:
            ids = tokenizer(prompt)["input_ids"]
            with torch.no_grad():
                out = model(input_ids=torch.tensor([ids]), use_cache=True)
                prompt_routes = hooks.stacked(len(ids))["topk_ids"].numpy()  # [P, L, K]
                past, token = out.past_key_values, int(out.logits[0, -1].argmax())
                steps, contexts = [], []
                for _ in range(max_tokens - 1):
                    ids = [*ids, token]
                    contexts.append(list(ids))
                    out = model(
                        input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True
                    )
                    past, token = out.past_key_values, int(out.logits[0, -1].argmax())
                    steps.append(hooks.stacked(1)["topk_ids"][0])  # [L, K]
            yield prompt_routes, torch.stack(steps).numpy(), contexts
    finally:
        hooks.remove()


def moe_layer_indices(model) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def count_tokens(
    tokenizer,
    documents: Iterable[tuple[str, str]],
    max_tokens: int | None = None,
    progress: str | None = None,
) -> int:
    """How many tokens :func:`trace` runs of ``documents`` (a re-iterable: it runs them
    again), ``max_tokens`` at most. Tokenizing is a small fraction of a forward pass."""
    from vllm_specexpert.tools.progress import progress_bar

    total = 0
    with progress_bar(f"{progress}: count tokens", unit="tok", disable=progress is None) as bar:
        for _, text in documents:
            n = len(_tokens(tokenizer, text))
            if max_tokens is not None:
                n = min(n, max_tokens - total)
            total += n
            bar.update(n)
            if max_tokens is not None and total >= max_tokens:
                break
    return total


def trace(
    model,
    tokenizer,
    documents: Iterable[tuple[str, str]],
    window: int = 256,
    max_tokens: int | None = None,
    progress: str | None = None,
) -> Iterator[WindowTrace]:
    """Run ``documents`` (``(name, text)`` pairs) in windows of ``window`` tokens (no
    context across windows) and yield each window's traces, ``max_tokens`` in all.

    ``progress``: the description of a progress bar of tokens run out of the total (on
    stderr, :func:`~vllm_specexpert.tools.progress.progress_bar`). The total is counted
    first when ``documents`` can be run twice (a list, :class:`Documents`); an iterator
    runs once, and its total is ``max_tokens`` (unknown without it)."""
    from vllm_specexpert.tools.progress import progress_bar

    total = max_tokens
    if progress is not None and not isinstance(documents, Iterator):
        total = count_tokens(tokenizer, documents, max_tokens, progress)
    hooks = _LayerHooks(model)
    seen = 0
    bar = progress_bar(progress or "", total=total, unit="tok", disable=progress is None)
    try:
        for name, text in documents:
            ids = _tokens(tokenizer, text)
            if max_tokens is not None:
                ids = ids[: max_tokens - seen]
            for begin in range(0, len(ids), window):
                chunk = torch.tensor(ids[begin : begin + window])
                with torch.no_grad():
                    model(input_ids=chunk[None])
                seen += len(chunk)
                bar.update(len(chunk))
                yield WindowTrace(document=name, token_ids=chunk, **hooks.stacked(len(chunk)))
            if max_tokens is not None and seen >= max_tokens:
                return
    finally:
        hooks.remove()
        bar.close()


class Documents:
    """``(name, text)`` pairs that can be iterated again (read each time: memory holds
    one document), for :func:`trace` to count the tokens before running them."""

    def __init__(self, read: Callable[[], Iterator[tuple[str, str]]]):
        self._read = read

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return self._read()


def corpus_documents(split: str) -> Documents:
    def read() -> Iterator[tuple[str, str]]:
        from vllm_specexpert.tools import corpus

        for f in corpus.corpus_files(split):
            yield f.relpath, f.read()

    return Documents(read)


def file_documents(paths: list[str]) -> Documents:
    def read() -> Iterator[tuple[str, str]]:
        for p in paths:
            yield p, Path(p).read_text(encoding="utf-8", errors="replace")

    return Documents(read)


def add_data_arguments(parser) -> None:
    """``MODEL`` and the text to run: ``--data FILE...`` or a corpus ``--split``."""
    from vllm_specexpert.tools.arguments import (
        data_files,
        positive_int,
        unquantized_model_dir,
    )

    parser.add_argument(
        "model",
        nargs="?",
        type=unquantized_model_dir,
        help="model directory (default: the embedded model)",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--data",
        nargs="+",
        type=data_files,
        help="text files to run, or globs of them ('src/**/*.py', quoted)",
    )
    source.add_argument(
        "--split",
        choices=["train", "validation", "test"],
        default=None,
        help="corpus split (`specexpert corpus`) to run when --data is not given",
    )
    parser.add_argument("--window", type=positive_int, default=256, help="tokens per forward pass")
    parser.add_argument("--max-tokens", type=positive_int, default=None)


def resolve_data_arguments(args, default_split: str) -> tuple[str, Documents, str]:
    """``(model_dir, documents, data description)`` from :func:`add_data_arguments`
    (empty ``--data`` files left out with a note; none with text: a ``UsageError``)."""
    from vllm_specexpert.tools.arguments import files_with_text
    from vllm_specexpert.tools.embedded_model import TRAINED_MODEL_DIR
    from vllm_specexpert.tools.provenance import file_label

    model = args.model or str(TRAINED_MODEL_DIR)
    if args.data:
        data = files_with_text([path for word in args.data for path in word])
        return model, file_documents(data), f"files {' '.join(map(file_label, data))}"
    split = args.split or default_split
    return model, corpus_documents(split), f"corpus split {split}"
