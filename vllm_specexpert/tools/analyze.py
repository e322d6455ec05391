"""How well can layer l predict layer l+1's experts? (speculating-experts Figures 3-5)

    specexpert analyze [MODEL] --calibration DIR [--estimator DIR]
                       [--data FILE... | --split validation] --out DIR

Runs held-out text through the transformers model and, for every pair of consecutive MoE
layers (l, l+1) and every predictor, compares the predicted routing of l+1 (made from
layer l's state with the same predictor code the plugin runs) with the router's:

* ``recall``: recall@k, the share of the router's k experts that the predicted k contain;
* ``cosine``: cosine similarity of the predictor's estimate of the router input to the
  true ``s_{l+1}`` (``router``: s_l itself; ``quasi_hidden``: q_l);
* ``rank_alignment[j]``: the share of tokens whose j-th expert by routing weight is the
  same in prediction and truth.

Predictors: ``router``, ``quasi_hidden`` (with ``--calibration``), ``estimator`` (with
``--estimator``, trained with that calibration) and ``hybrid`` (the estimator's row where
``quasi_hidden``'s recall is below its mean, as ``predictor: hybrid`` chooses by default).
Writes ``analysis.json`` (with the model's fingerprint: ``hybrid``'s ``analysis`` reads
it) and ``analysis.png`` to ``--out``: a new or empty directory, or one holding an
``analysis.json`` written before. ``--calibration`` and ``--estimator`` are checked
against the model before the model runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vllm_specexpert.calibration import load_calibration
from vllm_specexpert.predict import (
    EstimatorPredictor,
    LayerState,
    NextLayerRouting,
    Predictor,
    PredictorInputs,
    QuasiHiddenPredictor,
    RouterPredictor,
    residual_scale,
)
from vllm_specexpert.tools.arguments import (
    UsageError,
    check_artifact,
    check_output_dir,
    existing_dir,
    holding,
)
from vllm_specexpert.tools.provenance import command_line, model_label
from vllm_specexpert.tools.trace import (
    add_data_arguments,
    load_model,
    moe_layer_indices,
    resolve_data_arguments,
    trace,
)


def hf_routing(decoder_layer) -> NextLayerRouting:
    """A transformers decoder layer's routing (Qwen3-MoE-style ``mlp.gate``)."""

    gate = decoder_layer.mlp.gate

    def route(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, weights, ids = gate(hidden)
        return weights, ids

    def route_logits(
        hidden: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The gate's selection (softmax top-k, renormalized) on given logits.
        weights, ids = torch.softmax(logits.float(), dim=-1).topk(gate.top_k, dim=-1)
        if gate.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    return NextLayerRouting(
        norm=decoder_layer.post_attention_layernorm, route=route, route_logits=route_logits
    )


def hf_quasi_hidden(model, model_dir, calibration_dir) -> QuasiHiddenPredictor:
    """The ``quasi_hidden`` predictor of a transformers model from its calibration (layer
    names: the decoder-layer indices as strings)."""
    calibration = load_calibration(calibration_dir, model=str(model_dir))
    layers = moe_layer_indices(model)
    return QuasiHiddenPredictor(
        {str(i): calibration.default_vectors[i] for i in layers},
        {
            str(i): residual_scale(
                model.model.layers[i].post_attention_layernorm.weight.data,
                calibration.residual_rms[i],
            )
            for i in layers
        },
    )


class _Sums:
    """Running sums of one (transition, predictor) pair."""

    def __init__(self, top_k: int):
        self.tokens = 0
        self.recall = 0.0
        self.cosine = 0.0
        self.rank_hits = torch.zeros(top_k, dtype=torch.float64)

    def add(self, pred_w, pred_ids, true_w, true_ids, estimate, truth) -> None:
        self.tokens += len(true_ids)
        self.recall += float(
            (true_ids.unsqueeze(-1) == pred_ids.unsqueeze(-2)).any(-1).float().mean(-1).sum()
        )
        self.cosine += float(
            torch.nn.functional.cosine_similarity(estimate.float(), truth.float(), dim=-1).sum()
        )
        pred_ranked = pred_ids.gather(1, pred_w.argsort(-1, descending=True))
        true_ranked = true_ids.gather(1, true_w.argsort(-1, descending=True))
        self.rank_hits += (pred_ranked == true_ranked).double().sum(0)

    def result(self) -> dict:
        n = max(self.tokens, 1)
        return {
            "recall": self.recall / n,
            "cosine": self.cosine / n,
            "rank_alignment": (self.rank_hits / n).tolist(),
        }


def hf_estimator(
    quasi_hidden: QuasiHiddenPredictor, estimator_dir, model_dir, calibration_dir, layers: list[int]
) -> EstimatorPredictor:
    """The ``estimator`` predictor after every layer (layer names as in
    :func:`hf_quasi_hidden`)."""
    from vllm_specexpert.predict.estimator_network import load_estimator, transitions_of

    network = load_estimator(estimator_dir, model=str(model_dir), calibration=calibration_dir)
    inputs = PredictorInputs(
        quasi_hidden.default_vectors,
        quasi_hidden.residual_scales,
        network,
        transitions_of(network, {i: str(i) for i in layers}),
    )
    return EstimatorPredictor.build(inputs)


def analyze(
    model_dir,
    documents,
    calibration_dir=None,
    window: int = 256,
    max_tokens: int | None = None,
    estimator_dir=None,
) -> dict:
    from vllm_specexpert.artifacts import model_fingerprint

    model, tokenizer = load_model(model_dir)
    layers = moe_layer_indices(model)
    top_k = model.config.num_experts_per_tok
    predictors: dict[str, Predictor] = {"router": RouterPredictor()}
    if calibration_dir is not None:
        predictors["quasi_hidden"] = hf_quasi_hidden(model, model_dir, calibration_dir)
    if estimator_dir is not None:
        predictors["estimator"] = hf_estimator(
            predictors["quasi_hidden"], estimator_dir, model_dir, calibration_dir, layers
        )
    routing = {i: hf_routing(model.model.layers[i]) for i in layers}
    sums = {(j, name): _Sums(top_k) for j in range(len(layers) - 1) for name in predictors}
    tokens = 0
    for t in trace(model, tokenizer, documents, window, max_tokens, progress="analyze"):
        tokens += len(t.token_ids)
        for j in range(len(layers) - 1):
            state = LayerState(
                router_input=t.router_input[:, j],
                topk_ids=t.topk_ids[:, j],
                topk_weights=t.topk_weights[:, j],
            )
            nxt = routing[layers[j + 1]]
            for name, predictor in predictors.items():
                with torch.no_grad():
                    predicted = predictor.predict(state, str(layers[j]), nxt)
                    estimate = predicted.router_input
                    pred_w, pred_ids = predicted.topk_weights, predicted.topk_ids
                sums[(j, name)].add(
                    pred_w,
                    pred_ids,
                    t.topk_weights[:, j + 1],
                    t.topk_ids[:, j + 1],
                    estimate,
                    t.router_input[:, j + 1],
                )
    transitions = [
        {
            "from_layer": layers[j],
            "to_layer": layers[j + 1],
            **{name: sums[(j, name)].result() for name in predictors},
        }
        for j in range(len(layers) - 1)
    ]
    if "estimator" in predictors:
        add_hybrid(transitions)
    return {
        "model": model_label(model_dir),
        "model_fingerprint": model_fingerprint(model_dir),
        "tokens": tokens,
        "top_k": top_k,
        "num_experts": model.config.num_experts,
        "predictors": [*predictors, *(["hybrid"] if "estimator" in predictors else [])],
        "transitions": transitions,
    }


def add_hybrid(transitions: list[dict]) -> None:
    """The ``hybrid`` column: the estimator's row where the default threshold (the mean
    ``quasi_hidden`` recall) chooses it, ``quasi_hidden``'s elsewhere."""
    from vllm_specexpert.predict.hybrid import hybrid_layers

    chosen, _ = hybrid_layers({"transitions": transitions}, None)
    for row in transitions:
        row["hybrid"] = {
            **row["estimator" if row["from_layer"] in chosen else "quasi_hidden"],
            "uses_estimator": row["from_layer"] in chosen,
        }


def plot(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["transitions"]
    x = [r["to_layer"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name in result["predictors"]:
        axes[0].plot(x, [r[name]["recall"] for r in rows], marker="o", label=name)
        axes[1].plot(x, [r[name]["cosine"] for r in rows], marker="o", label=name)
        ranks = torch.tensor([r[name]["rank_alignment"] for r in rows]).mean(0)
        axes[2].plot(range(1, len(ranks) + 1), ranks, marker="o", label=name)
    axes[0].set(
        title=f"recall@{result['top_k']} of layer l+1's experts",
        xlabel="predicted layer l+1",
        ylim=(0, 1),
    )
    axes[1].set(title="cosine(estimate, s_{l+1})", xlabel="predicted layer l+1", ylim=(0, 1))
    axes[2].set(
        title="rank alignment (mean over layers)",
        xlabel="expert rank by routing weight",
        ylim=(0, 1),
    )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(result: dict) -> None:
    names = result["predictors"]
    print(f"{'l -> l+1':<10}" + "".join(f"{'recall ' + n:>20}{'cos ' + n:>18}" for n in names))
    for r in result["transitions"]:
        print(
            f"{r['from_layer']:>3} -> {r['to_layer']:<4}"
            + "".join(f"{r[n]['recall']:>20.3f}{r[n]['cosine']:>18.3f}" for n in names)
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_arguments(parser)
    parser.add_argument(
        "--calibration", type=existing_dir, help="calibration directory (adds quasi_hidden)"
    )
    parser.add_argument(
        "--estimator",
        type=existing_dir,
        help="estimator directory (`specexpert "
        "train-estimator`, with the same calibration; adds estimator and "
        "hybrid)",
    )
    parser.add_argument("--out", required=True, type=Path)


def run(args: argparse.Namespace) -> None:
    from vllm_specexpert.predict.estimator_network import load_estimator

    if args.estimator and not args.calibration:
        raise UsageError(
            "--estimator",
            "needs --calibration (the estimator maps "
            "quasi_hidden's q_l, made with the calibration's default vectors)",
        )
    check_output_dir(args.out, "--out", holding("analysis.json"), "an analysis")
    model, docs, description = resolve_data_arguments(args, default_split="validation")
    if args.calibration:
        check_artifact("--calibration", lambda: load_calibration(args.calibration, model=model))
    if args.estimator:
        check_artifact(
            "--estimator",
            lambda: load_estimator(args.estimator, model=model, calibration=args.calibration),
        )
    result = analyze(
        model,
        docs,
        args.calibration,
        window=args.window,
        max_tokens=args.max_tokens,
        estimator_dir=args.estimator,
    )
    command = command_line()
    result.update(data=description, command=command)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "analysis.json").write_text(json.dumps(result, indent=1))
    plot(
        result,
        args.out / "analysis.png",
        f"{result['model']}, {result['tokens']:,} tokens ({description})\n{command}",
    )
    print_table(result)
    print(f"wrote {args.out / 'analysis.json'} and analysis.png\ncommand: {command}")
