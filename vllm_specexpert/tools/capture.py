"""Capture per-token routing traces of a Hugging Face MoE model (transformers, CPU).

    specexpert capture [MODEL] [--data FILE... | --split validation] --out DIR

For every token and MoE layer l it records what a predictor of layer l's (or l+1's)
experts could want: the router logits, the selected experts and their weights, the
post-attention residual ``r_l`` (input of ``post_attention_layernorm``) and the router
input ``s_l`` (its output). Texts run one document at a time in windows of ``--window``
tokens (no context across windows); rows go to disk in shards, so memory stays bounded
by one shard whatever the amount of text.

Output format (``DIR``):

* ``manifest.json``: ``{"format": "specexpert-capture/1", "model", "model_fingerprint",
  "num_layers", "moe_layer_indices", "num_experts", "top_k", "hidden_size", "dtype",
  "window", "shards": [{"file", "tokens"}], "documents": [{"name", "start", "tokens"}],
  "tokens"}``. Rows are tokens in capture order; a document's rows are
  ``start .. start + tokens - 1`` (global indices).
* ``shard-NNNNN.safetensors``, each with, for its ``T`` rows:
  ``token_ids [T] int64``, ``positions [T] int64`` (position within its window),
  ``router_logits [T, L, E] float32``, ``topk_ids [T, L, K] int64``,
  ``topk_weights [T, L, K] float32`` (as passed to the experts, i.e. after the model's
  top-k renormalisation if any), ``residual [T, L, H]`` and ``router_input [T, L, H]``
  in ``dtype`` (default bfloat16).

``DIR`` is new, empty, or a capture written before (rewritten: its old shards go).
``model`` is the model's name (:func:`~vllm_specexpert.tools.provenance.model_label`).
Read it back with :class:`CaptureReader`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from vllm_specexpert.artifacts import model_fingerprint
from vllm_specexpert.tools.arguments import (
    artifact_of,
    check_output_dir,
    positive_int,
)
from vllm_specexpert.tools.provenance import model_label
from vllm_specexpert.tools.trace import (
    add_data_arguments,
    load_model,
    moe_layer_indices,
    resolve_data_arguments,
    trace,
)

FORMAT = "specexpert-capture/1"
STORED = (
    "token_ids",
    "positions",
    "router_logits",
    "topk_ids",
    "topk_weights",
    "residual",
    "router_input",
)


def capture(
    model_dir: str | Path,
    documents: Iterable[tuple[str, str]],
    out: str | Path,
    window: int = 256,
    shard_tokens: int = 65536,
    dtype: str = "bfloat16",
    max_tokens: int | None = None,
) -> dict:
    """Run ``documents`` (``(name, text)`` pairs) through the model and write the
    capture to ``out``. Returns the manifest."""
    from safetensors.torch import save_file

    out = Path(out)
    model, tokenizer = load_model(model_dir)
    config = model.config
    store_dtype = getattr(torch, dtype)
    layers = moe_layer_indices(model)
    manifest = {
        "format": FORMAT,
        "model": model_label(model_dir),
        "model_fingerprint": model_fingerprint(model_dir),
        "num_layers": len(layers),
        "moe_layer_indices": layers,
        "num_experts": config.num_experts,
        "top_k": config.num_experts_per_tok,
        "hidden_size": config.hidden_size,
        "dtype": dtype,
        "window": window,
        "shards": [],
        "documents": [],
        "tokens": 0,
    }
    buffer: dict[str, list[torch.Tensor]] = {k: [] for k in STORED}
    buffered = 0
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)
    for old in out.glob("shard-*.safetensors"):  # a capture written before
        old.unlink()

    def flush() -> None:
        nonlocal buffered
        if buffered:
            name = f"shard-{len(manifest['shards']):05d}.safetensors"
            save_file({k: torch.cat(v).contiguous() for k, v in buffer.items()}, str(out / name))
            manifest["shards"].append({"file": name, "tokens": buffered})
            for v in buffer.values():
                v.clear()
            buffered = 0

    for t in trace(model, tokenizer, documents, window, max_tokens, progress="capture"):
        docs = manifest["documents"]
        if not docs or docs[-1]["name"] != t.document:
            docs.append({"name": t.document, "start": manifest["tokens"], "tokens": 0})
        docs[-1]["tokens"] += len(t.token_ids)
        buffer["token_ids"].append(t.token_ids)
        buffer["positions"].append(torch.arange(len(t.token_ids)))
        buffer["router_logits"].append(t.router_logits)
        buffer["topk_ids"].append(t.topk_ids)
        buffer["topk_weights"].append(t.topk_weights)
        buffer["residual"].append(t.residual.to(store_dtype))
        buffer["router_input"].append(t.router_input.to(store_dtype))
        buffered += len(t.token_ids)
        manifest["tokens"] += len(t.token_ids)
        if buffered >= shard_tokens:
            flush()
    flush()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


class CaptureReader:
    """Reads a capture directory shard by shard (see module doc for the format)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        manifest_path = self.path / "manifest.json"
        if not manifest_path.exists():
            raise FileNotFoundError(f"{self.path} is not a capture (no manifest.json)")
        self.manifest = json.loads(manifest_path.read_text())
        if self.manifest.get("format") != FORMAT:
            raise ValueError(
                f"{self.path}: format {self.manifest.get('format')!r}, expected {FORMAT}"
            )

    @property
    def tokens(self) -> int:
        return self.manifest["tokens"]

    def shards(self, keys: Iterable[str] | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Yield each shard as a dict of tensors (only ``keys`` if given)."""
        from safetensors import safe_open

        for shard in self.manifest["shards"]:
            with safe_open(str(self.path / shard["file"]), "pt") as f:
                names = f.keys() if keys is None else keys
                yield {k: f.get_tensor(k) for k in names}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_arguments(parser)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--shard-tokens", type=positive_int, default=65536)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")


def run(args: argparse.Namespace) -> None:
    check_output_dir(args.out, "--out", artifact_of(FORMAT), "a capture")
    model, docs, _ = resolve_data_arguments(args, default_split="validation")
    manifest = capture(
        model,
        docs,
        args.out,
        window=args.window,
        shard_tokens=args.shard_tokens,
        dtype=args.dtype,
        max_tokens=args.max_tokens,
    )
    print(
        f"captured {manifest['tokens']:,} tokens x {manifest['num_layers']} layers "
        f"in {len(manifest['shards'])} shard(s) -> {args.out}"
    )
