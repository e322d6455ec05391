"""Train the neural expert estimator of a model: ``specexpert train-estimator``.

    specexpert train-estimator [MODEL] [--data FILE... | --split train] --out DIR
                               [--calibration DIR] [--max-tokens 200000] [--steps 2000]

1. Capture: the model (transformers, CPU) runs over the text in windows; for every token
   and layer transition l -> l+1 it keeps the quasi-hidden state q_l (the
   ``quasi_hidden`` predictor's estimate of layer l+1's router input, with the
   calibration's default vectors) and layer l+1's router logits.
2. Train :class:`~vllm_specexpert.predict.estimator_network.ExpertEstimator` by KL distillation
   against the router's logits (AdamW, cosine schedule), one network for every
   transition; every ``--eval-every`` steps its recall@k is measured on the model's
   held-out validation text (``--eval-tokens``) beside ``quasi_hidden``'s on the same
   tokens: the hit rate against training tokens (speculating-experts Fig. 9).
3. Save ``DIR``: ``estimator.safetensors`` + ``manifest.json`` (the model's
   fingerprint, the calibration by the sha256 of its tensors and its path relative to
   ``DIR``, the data), ``training.json`` and ``training.png``. ``DIR`` is new, empty, or
   an estimator written before. The calibration is checked against the model first.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path

import torch

from vllm_specexpert.artifacts import file_sha256, model_fingerprint
from vllm_specexpert.predict import LayerState
from vllm_specexpert.predict.estimator_network import (
    EstimatorShape,
    ExpertEstimator,
    distillation_loss,
    save_estimator,
)
from vllm_specexpert.tools.arguments import (
    artifact_of,
    check_artifact,
    check_output_dir,
    check_shape,
    existing_dir,
    positive_int,
)
from vllm_specexpert.tools.progress import progress_bar
from vllm_specexpert.tools.provenance import command_line, model_label, path_label
from vllm_specexpert.tools.trace import (
    add_data_arguments,
    corpus_documents,
    load_model,
    moe_layer_indices,
    resolve_data_arguments,
    trace,
)


def capture(
    model_dir, documents, calibration_dir, window: int, max_tokens: int, progress: str
) -> dict:
    """``q [N, J, H]`` (float32) and ``router_logits [N, J, E]`` of layer l+1 for every
    token and transition j, the quasi-hidden predictor's top-k ids of layer l+1
    ``qh_ids [N, J, K]`` and the router's ``true_ids [N, J, K]``, ``max_tokens`` in all."""
    from vllm_specexpert.tools.analyze import hf_quasi_hidden, hf_routing

    model, tokenizer = load_model(model_dir)
    layers = moe_layer_indices(model)
    predictor = hf_quasi_hidden(model, model_dir, calibration_dir)
    routing = {i: hf_routing(model.model.layers[i]) for i in layers}
    out: dict[str, list] = {"q": [], "router_logits": [], "qh_ids": [], "true_ids": []}
    digest = hashlib.sha256()
    for t in trace(model, tokenizer, documents, window, max_tokens, progress=progress):
        digest.update(t.token_ids.numpy().tobytes())
        qs, qh = [], []
        for j in range(len(layers) - 1):
            state = LayerState(
                router_input=t.router_input[:, j],
                topk_ids=t.topk_ids[:, j],
                topk_weights=t.topk_weights[:, j],
            )
            nxt = routing[layers[j + 1]]
            with torch.no_grad():
                q = predictor.next_router_input(state, str(layers[j]), nxt)
                qh.append(nxt.route(q)[1])
            qs.append(q.float())
        out["q"].append(torch.stack(qs, dim=1))
        out["qh_ids"].append(torch.stack(qh, dim=1).long())
        out["router_logits"].append(t.router_logits[:, 1:].float())
        out["true_ids"].append(t.topk_ids[:, 1:])
    data = {k: torch.cat(v) for k, v in out.items()}
    data["info"] = {
        "moe_layer_indices": layers,
        "hidden_size": model.config.hidden_size,
        "num_experts": model.config.num_experts,
        "top_k": model.config.num_experts_per_tok,
        "tokens_sha256": digest.hexdigest(),
    }
    return data


def recall(pred_ids: torch.Tensor, true_ids: torch.Tensor) -> torch.Tensor:
    """``[J]`` recall@k per transition: the share of the router's top-k the prediction
    contains, over tokens (``[N, J, K]`` ids each)."""
    hits = (true_ids.unsqueeze(-1) == pred_ids.unsqueeze(-2)).any(-1).float()
    return hits.mean(dim=(0, 2))


@torch.no_grad()
def estimator_recall(
    model: ExpertEstimator, q: torch.Tensor, true_ids: torch.Tensor
) -> torch.Tensor:
    k = true_ids.shape[-1]
    ids = torch.stack([model(q[:, j], j).topk(k, dim=-1).indices for j in range(q.shape[1])], dim=1)
    return recall(ids, true_ids)


def train(
    data: dict,
    held: dict,
    shape: EstimatorShape,
    steps: int,
    eval_every: int,
    batch: int = 1024,
    lr: float = 2e-3,
    seed: int = 0,
) -> tuple[ExpertEstimator, list[dict]]:
    """Fit the estimator on ``data``; the curve: its mean held-out recall every
    ``eval_every`` steps, against the training tokens seen."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = ExpertEstimator(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    n, transitions = data["q"].shape[:2]
    curve = []
    bar = progress_bar("train estimator", total=steps, unit="step")
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            model.eval()
            per_layer = estimator_recall(model, held["q"], held["true_ids"])
            curve.append(
                {
                    "step": step,
                    "training_tokens": step * batch,
                    "recall": float(per_layer.mean()),
                    "recall_per_transition": per_layer.tolist(),
                }
            )
            bar.set_postfix(recall=f"{curve[-1]['recall']:.3f}", refresh=False)
            model.train()
        if step == steps:
            break
        rows = torch.randint(n, (batch,), generator=g)
        j = torch.randint(transitions, (batch,), generator=g)
        loss = distillation_loss(model(data["q"][rows, j], j), data["router_logits"][rows, j])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        bar.update()
    bar.close()
    return model.eval(), curve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_arguments(parser)
    parser.set_defaults(max_tokens=200_000)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument(
        "--calibration",
        type=existing_dir,
        help="calibration directory (default: the embedded model's)",
    )
    parser.add_argument("--steps", type=positive_int, default=2000)
    parser.add_argument("--eval-every", type=positive_int, default=200)
    parser.add_argument(
        "--eval-tokens",
        type=positive_int,
        default=16384,
        help="held-out validation tokens for the recall curve",
    )
    parser.add_argument("--latent", type=positive_int, default=EstimatorShape.latent)
    parser.add_argument("--mlp-ratio", type=positive_int, default=EstimatorShape.mlp_ratio)


def run(args: argparse.Namespace) -> None:
    from vllm_specexpert.calibration import WEIGHTS_FILE as calibration_file
    from vllm_specexpert.calibration import load_calibration
    from vllm_specexpert.predict.estimator_network import FORMAT
    from vllm_specexpert.tools.embedded_model import TRAINED_CALIBRATION_DIR

    check_output_dir(args.out, "--out", artifact_of(FORMAT), "an estimator")
    check_shape(
        EstimatorShape,
        {"--latent": ("latent", args.latent), "--mlp-ratio": ("mlp_ratio", args.mlp_ratio)},
        hidden_size=1,
        num_transitions=1,
        num_experts=1,
        top_k=1,
    )
    model_dir, documents, description = resolve_data_arguments(args, default_split="train")
    calibration = args.calibration or str(TRAINED_CALIBRATION_DIR)
    check_artifact("--calibration", lambda: load_calibration(calibration, model=model_dir))
    started = time.perf_counter()
    data = capture(model_dir, documents, calibration, args.window, args.max_tokens, "capture q_l")
    held = capture(
        model_dir,
        corpus_documents("validation"),
        calibration,
        args.window,
        args.eval_tokens,
        "capture held-out",
    )
    info = data.pop("info")
    held.pop("info")
    shape = EstimatorShape(
        hidden_size=info["hidden_size"],
        num_transitions=len(info["moe_layer_indices"]) - 1,
        num_experts=info["num_experts"],
        top_k=info["top_k"],
        latent=args.latent,
        mlp_ratio=args.mlp_ratio,
    )
    estimator, curve = train(data, held, shape, args.steps, args.eval_every)
    estimator.layer_indices = info["moe_layer_indices"]
    quasi_hidden = recall(held["qh_ids"], held["true_ids"])
    result = {
        "command": command_line(),
        "parameters": sum(p.numel() for p in estimator.parameters()),
        "held_out_tokens": len(held["q"]),
        "curve": curve,
        "quasi_hidden_recall_per_transition": quasi_hidden.tolist(),
        "estimator_recall_per_transition": curve[-1]["recall_per_transition"],
        "seconds": time.perf_counter() - started,
    }
    save_estimator(
        args.out,
        estimator,
        {
            "model": model_label(model_dir),
            "model_fingerprint": model_fingerprint(model_dir),
            # q_l depends on the calibration's default vectors: the engine refuses another
            # (by the sha256; the path is for people).
            "calibration": {
                "path": path_label(calibration, args.out),
                "sha256": file_sha256(Path(calibration) / calibration_file),
            },
            "data": {
                "description": description,
                "tokens": len(data["q"]),
                "sha256": info["tokens_sha256"],
            },
            "training": {k: result[k] for k in ("parameters", "held_out_tokens", "seconds")},
        },
    )
    (args.out / "training.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "training.png")
    print(
        f"estimator: {result['parameters'] / 1e6:.2f} M parameters; held-out recall@k "
        f"{curve[-1]['recall']:.3f} (quasi_hidden {float(quasi_hidden.mean()):.3f}); "
        f"{result['seconds']:.0f} s -> {args.out}"
    )
    for j, (est, qh) in enumerate(
        zip(
            result["estimator_recall_per_transition"],
            result["quasi_hidden_recall_per_transition"],
            strict=True,
        )
    ):
        layers = info["moe_layer_indices"]
        print(f"  layer {layers[j]} -> {layers[j + 1]}: estimator {est:.3f}, quasi_hidden {qh:.3f}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    curve = result["curve"]
    left.plot(
        [c["training_tokens"] / 1e6 for c in curve],
        [c["recall"] for c in curve],
        marker="o",
        label="estimator",
    )
    left.axhline(
        sum(result["quasi_hidden_recall_per_transition"])
        / len(result["quasi_hidden_recall_per_transition"]),
        color="k",
        ls="--",
        label="quasi_hidden",
    )
    left.set_xlabel("training samples (M token-transitions)")
    left.set_ylabel("held-out recall@k (mean over transitions)")
    left.legend()
    est, qh = (
        result["estimator_recall_per_transition"],
        result["quasi_hidden_recall_per_transition"],
    )
    xs = range(1, len(est) + 1)
    right.bar([x - 0.2 for x in xs], qh, width=0.4, label="quasi_hidden")
    right.bar([x + 0.2 for x in xs], est, width=0.4, label="estimator")
    right.set_xlabel("transition (l -> l+1), predicted layer")
    right.set_ylabel("held-out recall@k")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
