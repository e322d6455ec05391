"""Evaluate a routing-path predictor on held-out text: ``specexpert eval-path``.

    specexpert eval-path [MODEL] --path-predictor DIR [--data FILE... | --split S]
                         [--calibration DIR] [--batches 1 8 32] [--out DIR]

The model (transformers, CPU) runs over the text in windows; every token's true routing
path is compared with what each method predicted for it, per MoE layer, top-k experts
per token and layer each:

* ``rpp``: the routing-path predictor, from the token's window of ids;
* ``tlp``: ExpertFlow's temporal-locality baseline, the same sequence's routing at the
  previous step (the previous token's experts; nothing at a window's first token);
* ``slp``: its spatial-locality baseline, the same token's experts at the previous MoE
  layer (nothing at the first layer);
* ``quasi_hidden`` (with a calibration): this project's next-layer predictor, from the
  previous layer's state of the same token (nothing at the first layer).

Batch-level accuracy (ExpertFlow §4.3.3): for a decode step of ``b`` sequences, the
layer's experts the batch truly activates (OR over its tokens) that the OR of the
predictions contains, averaged over layers; ``b`` tokens drawn at random from the
held-out tokens per step, ``--samples`` steps. At ``b = 1`` it is per-token recall@k.
The headline average runs over layers 1..L-1, where every method predicts; per-layer
curves (the shape of the paper's Fig. 9) include layer 0. Writes ``path_eval.json`` and
``path_eval.png`` (default: into the path-predictor directory; ``--out``: a new or empty
directory, or one holding a ``path_eval.json`` or a path predictor). The path predictor
and the calibration are checked against the model before the model runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from vllm_specexpert.predict.path import FORMAT, load_path_predictor, sliding_windows
from vllm_specexpert.tools.arguments import (
    UsageError,
    artifact_of,
    check_artifact,
    check_output_dir,
    existing_dir,
    holding,
    positive_int,
)
from vllm_specexpert.tools.provenance import (
    command_line,
    file_label,
    model_label,
    path_label,
)
from vllm_specexpert.tools.trace import (
    add_data_arguments,
    file_documents,
    load_model,
    moe_layer_indices,
    resolve_data_arguments,
    trace,
)


def _one_hot(ids: torch.Tensor, num_experts: int, valid: torch.Tensor | None = None) -> np.ndarray:
    """``[T, L, K]`` ids -> ``[T, L, E]`` bool; rows/layers where ``valid`` ([T, L]) is
    false predict nothing."""
    out = torch.zeros(*ids.shape[:2], num_experts, dtype=torch.bool)
    out.scatter_(-1, ids, True)
    if valid is not None:
        out &= valid[..., None]
    return out.numpy()


def evaluate(
    model_dir,
    documents,
    predictor_dir,
    calibration_dir=None,
    window: int = 256,
    max_tokens: int | None = None,
    batches=(1, 8, 32),
    samples: int = 400,
    seed: int = 0,
) -> dict:
    """Per method and batch size: per-layer batch-level accuracy and its mean over
    layers 1..L-1 (see module doc)."""
    model, tokenizer = load_model(model_dir)
    layers = moe_layer_indices(model)
    num_experts = model.config.num_experts
    top_k = model.config.num_experts_per_tok
    rpp = load_path_predictor(predictor_dir, model=str(model_dir))
    pad = rpp.shape.vocab_size
    qh = None
    if calibration_dir is not None:
        from vllm_specexpert.predict import LayerState
        from vllm_specexpert.tools.analyze import hf_quasi_hidden, hf_routing

        qh = hf_quasi_hidden(model, model_dir, calibration_dir)
        routing = {i: hf_routing(model.model.layers[i]) for i in layers}
    parts: dict[str, list[np.ndarray]] = {m: [] for m in ("truth", "rpp", "tlp", "slp")}
    if qh is not None:
        parts["quasi_hidden"] = []
    for t in trace(model, tokenizer, documents, window, max_tokens, progress="eval-path"):
        truth = t.topk_ids  # [T, L, K]
        tokens, num_layers = truth.shape[:2]
        parts["truth"].append(_one_hot(truth, num_experts))
        parts["rpp"].append(
            _one_hot(
                rpp.predict_topk(sliding_windows(t.token_ids, rpp.shape.window, pad)), num_experts
            )
        )
        first_token = torch.ones(tokens, num_layers, dtype=torch.bool)
        first_token[0] = False
        parts["tlp"].append(_one_hot(truth.roll(1, 0), num_experts, first_token))
        first_layer = torch.ones(tokens, num_layers, dtype=torch.bool)
        first_layer[:, 0] = False
        parts["slp"].append(_one_hot(truth.roll(1, 1), num_experts, first_layer))
        if qh is not None:
            predicted = torch.zeros_like(truth)
            with torch.no_grad():
                for j in range(num_layers - 1):
                    state = LayerState(t.router_input[:, j], truth[:, j], t.topk_weights[:, j])
                    nxt = routing[layers[j + 1]]
                    _, ids = nxt.route(qh.next_router_input(state, str(layers[j]), nxt))
                    predicted[:, j + 1] = ids
            parts["quasi_hidden"].append(_one_hot(predicted, num_experts, first_layer))
    data = {m: np.concatenate(v) for m, v in parts.items()}
    truth = data.pop("truth")
    if max(batches) > len(truth):
        raise UsageError(
            "--batches",
            f"a batch of {max(batches)} sequences is more than the {len(truth)} tokens run",
        )
    rng = np.random.default_rng(seed)
    results: dict[str, dict] = {m: {} for m in data}
    for b in batches:
        if b == 1:
            groups = np.arange(len(truth))[:, None]
        else:
            groups = np.stack([rng.choice(len(truth), b, replace=False) for _ in range(samples)])
        true_or = truth[groups].any(axis=1)  # [S, L, E]
        active = true_or.sum(-1)  # [S, L]
        for method, predicted in data.items():
            hit = (true_or & predicted[groups].any(axis=1)).sum(-1)
            per_layer = (hit / np.maximum(active, 1)).mean(0)
            results[method][str(b)] = {
                "per_layer": per_layer.tolist(),
                "b_acc": float(per_layer[1:].mean()),
            }
    return {
        "model": model_label(model_dir),
        "path_predictor": str(predictor_dir),
        "tokens": len(truth),
        "moe_layer_indices": layers,
        "num_experts": num_experts,
        "top_k": top_k,
        "batches": list(batches),
        "samples": samples,
        "methods": list(data),
        "results": results,
    }


def plot(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = result["batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    layers = list(range(len(result["moe_layer_indices"])))
    for ax, b in zip(axes[0], batches, strict=True):
        for method in result["methods"]:
            row = result["results"][method][str(b)]
            ax.plot(
                layers, row["per_layer"], marker="o", label=f"{method} (B_acc {row['b_acc']:.3f})"
            )
        ax.set(
            title=f"batch {b}", xlabel="MoE layer", ylabel="batch-level accuracy", ylim=(0, 1.02)
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(result: dict) -> None:
    batches = result["batches"]
    print(f"{'method':<14}" + "".join(f"{'B_acc@' + str(b):>12}" for b in batches))
    for method in result["methods"]:
        print(
            f"{method:<14}"
            + "".join(f"{result['results'][method][str(b)]['b_acc']:>12.3f}" for b in batches)
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_arguments(parser)
    parser.add_argument("--path-predictor", required=True, type=existing_dir)
    parser.add_argument(
        "--calibration",
        type=existing_dir,
        help="calibration directory "
        "(adds quasi_hidden; default: the shipped one for the embedded model)",
    )
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--samples", type=positive_int, default=400)
    parser.add_argument("--out", type=Path, help="default: the path-predictor directory")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specexpert eval-path")
    add_arguments(parser)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    from vllm_specexpert.calibration import load_calibration
    from vllm_specexpert.tools.embedded_model import (
        TRAINED_CALIBRATION_DIR,
        TRAINED_MODEL_DIR,
    )

    predictor = Path(args.path_predictor)
    out = check_output_dir(
        args.out or predictor,
        "--out",
        lambda p: holding("path_eval.json")(p) or artifact_of(FORMAT)(p),
        "a path evaluation",
    )
    if args.max_tokens is not None and max(args.batches) > args.max_tokens:
        raise UsageError(
            "--batches",
            f"a batch of {max(args.batches)} sequences is more than --max-tokens {args.max_tokens}",
        )
    model, docs, description = resolve_data_arguments(args, default_split="validation")
    held_out = Path(model, "heldout", "validation.txt")
    if not args.data and args.split is None and held_out.exists():
        docs, description = file_documents([str(held_out)]), f"file {file_label(held_out)}"
    calibration = args.calibration
    if calibration is None and Path(model).resolve() == TRAINED_MODEL_DIR.resolve():
        calibration = str(TRAINED_CALIBRATION_DIR)
    check_artifact("--path-predictor", lambda: load_path_predictor(predictor, model=model))
    if calibration is not None:
        check_artifact("--calibration", lambda: load_calibration(calibration, model=model))
    result = evaluate(
        model,
        docs,
        predictor,
        calibration,
        window=args.window,
        max_tokens=args.max_tokens,
        batches=args.batches,
        samples=args.samples,
    )
    command = command_line()
    result.update(path_predictor=path_label(predictor, out), data=description, command=command)
    out.mkdir(parents=True, exist_ok=True)
    (out / "path_eval.json").write_text(json.dumps(result, indent=1))
    plot(
        result,
        out / "path_eval.png",
        f"{result['model']}: {result['tokens']:,} held-out tokens ({description})\n{command}",
    )
    print_table(result)
    print(f"wrote {out / 'path_eval.json'} and path_eval.png")
