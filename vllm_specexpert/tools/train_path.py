"""Train the routing-path predictor (RPP) of a model: ``specexpert train-path``.

    specexpert train-path [MODEL] [--data FILE... | --split train] --out DIR
                          [--max-tokens 600000] [--steps 3000]

1. Capture: the model (transformers, CPU) runs over the text in windows, and every
   token's routing path is kept as its ``[L, K]`` expert ids, next to the token ids.
2. Train: :class:`~vllm_specexpert.predict.path.RoutingPathPredictor` on (the token's
   window of ids -> its ``[L, E]`` routing matrix) with binary cross-entropy
   (ExpertFlow eq. 1), Adam, cosine schedule; 2 % of the windows held out to report a
   validation loss.
3. Save ``DIR`` (safetensors + manifest with the model's fingerprint) and evaluate it on
   the model's held-out validation text (``specexpert eval-path``, unless ``--no-eval``).
   ``DIR`` is new, empty, or a path predictor written before.

Defaults finish in about 10 minutes on a 2-core machine for the embedded model.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import time
from pathlib import Path

import torch

from vllm_specexpert.artifacts import model_fingerprint
from vllm_specexpert.predict.path import (
    FORMAT,
    PathPredictorShape,
    RoutingPathPredictor,
    save_path_predictor,
    sliding_windows,
)
from vllm_specexpert.tools.arguments import (
    artifact_of,
    check_output_dir,
    check_shape,
    positive_int,
)
from vllm_specexpert.tools.progress import progress_bar
from vllm_specexpert.tools.provenance import model_label
from vllm_specexpert.tools.trace import (
    add_data_arguments,
    load_model,
    moe_layer_indices,
    resolve_data_arguments,
    trace,
)


def capture_paths(
    model_dir, documents, window: int, max_tokens: int, context: int
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(windows [N, context] int64, paths [N, L, K] int64, info)`` for every token of
    ``documents`` (``(name, text)`` pairs), ``max_tokens`` in all."""
    model, tokenizer = load_model(model_dir)
    config = model.config
    pad = config.vocab_size
    windows, paths = [], []
    digest = hashlib.sha256()
    for t in trace(model, tokenizer, documents, window, max_tokens, progress="capture routes"):
        digest.update(t.token_ids.numpy().tobytes())
        windows.append(sliding_windows(t.token_ids, context, pad))
        paths.append(t.topk_ids)
    info = {
        "vocab_size": config.vocab_size,
        "num_layers": len(moe_layer_indices(model)),
        "num_experts": config.num_experts,
        "top_k": config.num_experts_per_tok,
        "moe_layer_indices": moe_layer_indices(model),
        "tokens_sha256": digest.hexdigest(),
    }
    return torch.cat(windows), torch.cat(paths), info


def routing_matrix(paths: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[N, L, K]`` expert ids -> ``[N, L, E]`` 0/1 float."""
    out = torch.zeros(*paths.shape[:2], num_experts)
    return out.scatter_(-1, paths, 1.0)


def train(
    windows: torch.Tensor,
    paths: torch.Tensor,
    shape: PathPredictorShape,
    steps: int,
    batch: int = 512,
    lr: float = 3e-3,
    seed: int = 0,
) -> tuple[RoutingPathPredictor, dict]:
    """Fit the predictor; returns it (eval mode) and its losses."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    order = torch.randperm(len(windows), generator=g)
    held = order[: max(len(order) // 50, 1)]
    fit = order[len(held) :]
    model = RoutingPathPredictor(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    loss_fn = torch.nn.BCEWithLogitsLoss()
    started = time.perf_counter()
    bar = progress_bar("train path predictor", total=steps, unit="step")
    loss = torch.tensor(0.0)
    for step in range(steps):
        rows = fit[torch.randint(len(fit), (batch,), generator=g)]
        logits = model(windows[rows])
        loss = loss_fn(logits, routing_matrix(paths[rows], shape.num_experts))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0:
            bar.set_postfix(bce=f"{loss.item():.4f}", refresh=False)
        bar.update()
    bar.close()
    model.eval()
    with torch.no_grad():
        held_loss = sum(
            float(loss_fn(model(windows[chunk]), routing_matrix(paths[chunk], shape.num_experts)))
            * len(chunk)
            for chunk in held.split(4096)
        ) / len(held)
    return model, {
        "train_bce": float(loss),
        "held_out_bce": held_loss,
        "steps": steps,
        "batch": batch,
        "seconds": time.perf_counter() - started,
        "windows": len(windows),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_arguments(parser)
    parser.set_defaults(max_tokens=600_000)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=positive_int, default=3000)
    parser.add_argument(
        "--context",
        type=positive_int,
        default=PathPredictorShape.window,
        help="token ids the predictor reads (the current one included)",
    )
    parser.add_argument(
        "--hidden",
        type=positive_int,
        default=PathPredictorShape.hidden,
        help="width of the MLP's hidden layers",
    )
    parser.add_argument("--embed-dim", type=positive_int, default=PathPredictorShape.embed_dim)
    parser.add_argument(
        "--no-eval", action="store_true", help="skip the evaluation on the model's held-out text"
    )


def run(args: argparse.Namespace) -> None:
    check_output_dir(args.out, "--out", artifact_of(FORMAT), "a path predictor")
    check_shape(
        PathPredictorShape,
        {
            "--context": ("window", args.context),
            "--hidden": ("hidden", args.hidden),
            "--embed-dim": ("embed_dim", args.embed_dim),
        },
        vocab_size=1,
        num_layers=1,
        num_experts=1,
        top_k=1,
    )
    model_dir, documents, description = resolve_data_arguments(args, default_split="train")
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    windows, paths, info = capture_paths(
        model_dir, documents, args.window, args.max_tokens, args.context
    )
    shape = PathPredictorShape(
        vocab_size=info["vocab_size"],
        num_layers=info["num_layers"],
        num_experts=info["num_experts"],
        top_k=info["top_k"],
        window=args.context,
        embed_dim=args.embed_dim,
        hidden=args.hidden,
    )
    predictor, training = train(windows, paths, shape, args.steps)
    predictor.layer_indices = info["moe_layer_indices"]
    manifest = {
        "model": model_label(model_dir),
        "model_fingerprint": model_fingerprint(model_dir),
        "data": {
            "description": description,
            "tokens": len(windows),
            "sha256": info["tokens_sha256"],
        },
        "training": training,
    }
    save_path_predictor(args.out, predictor, manifest)
    print(
        f"path predictor: {sum(p.numel() for p in predictor.parameters()) / 1e6:.2f} M "
        f"parameters, held-out BCE {training['held_out_bce']:.4f}, "
        f"{training['seconds']:.0f} s of training -> {args.out}"
    )
    if not args.no_eval:
        from vllm_specexpert.tools import eval_path

        eval_path.run(eval_path.parse([str(model_dir), "--path-predictor", str(args.out)]))
