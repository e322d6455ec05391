"""Train the embedded default model: a small Qwen3-MoE with learned routing.

    specexpert train-tiny [--out DIR] [--steps N] [--quick]

A decoder-only MoE in the Hugging Face Qwen3-MoE format, trained from scratch on this
machine's CPU on the CPython standard library (:mod:`vllm_specexpert.tools.corpus`), so the
project has a model whose router has learned something without downloading one. The
run is seeded and reproducible for a given corpus fingerprint and torch build; it writes
the checkpoint (bf16 safetensors, tokenizer), ``metrics.json``, ``loss.png`` and a model
card ``README.md`` with the command, corpus fingerprint, wall time, losses, per-layer
routing entropy and expert utilization, and greedy samples.

Routing is trained with a per-layer load-balancing loss (Switch Transformer's
``E * sum_e f_e * P_e``, averaged over layers), so that every layer spreads its tokens
over its experts instead of collapsing onto a few.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_specexpert.tools.fixtures import TRAINED_MODEL_DIR

EVAL_SEQ_LEN = 256
CARD_FILES = 3
"""Validation files whose individual losses the model card records (the artifact test
recomputes them)."""
SAMPLE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(items)):\n",
]


@dataclass(frozen=True)
class TrainConfig:
    """Shape and schedule. The defaults are what the committed model was trained with."""

    num_hidden_layers: int = 6
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_experts: int = 32
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 64
    seq_len: int = 256
    batch_size: int = 16
    """Sequences per optimizer step."""
    steps: int = 1800
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    balance_coef: float = 0.01
    """Weight of the per-layer load-balancing loss."""
    seed: int = 0
    threads: int = 2

    def hf_config(self):
        from transformers import Qwen3MoeConfig

        from vllm_specexpert.tools.fixtures import VOCAB_SIZE

        config = Qwen3MoeConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=self.hidden_size,
            intermediate_size=4 * self.hidden_size,  # unused: every layer is sparse
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            router_aux_loss_coef=self.balance_coef,
            initializer_range=0.02,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=1,
        )
        config.architectures = ["Qwen3MoeForCausalLM"]
        return config


# ------------------------------------------------------------------------- data


def tokenize_split(split: str, files=None):
    """One 1-D int64 tensor: every file of ``split`` encoded, each followed by EOS."""
    import torch

    from vllm_specexpert.tools import corpus
    from vllm_specexpert.tools.fixtures import load_tokenizer

    tokenizer = load_tokenizer()
    files = corpus.corpus_files(split) if files is None else files
    eos = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for encoding in tokenizer.encode_batch([f.read() for f in files]):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def unigram_entropy(tokens) -> float:
    """Entropy (nats) of the token frequency distribution: the loss of the best model
    that ignores context."""
    import torch

    counts = torch.bincount(tokens).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


# ----------------------------------------------------------------------- losses


def balance_loss(router_logits, top_k: int):
    """Switch-style load balancing per layer, averaged over layers."""
    import torch

    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        num_experts = probs.shape[-1]
        chosen = probs.topk(top_k, dim=-1).indices
        fraction = torch.bincount(chosen.reshape(-1), minlength=num_experts).float()
        fraction = fraction / chosen.numel()
        losses.append(num_experts * (fraction * probs.mean(0)).sum())
    return torch.stack(losses).mean()


@dataclass
class EvalResult:
    loss: float
    tokens: int


def evaluate_loss(model, tokens, seq_len: int = EVAL_SEQ_LEN, batch: int = 16) -> EvalResult:
    """Mean next-token NLL over ``tokens`` cut into non-overlapping windows (each
    window predicts its tokens 1..n from its own prefix)."""
    import torch

    n = (len(tokens) - 1) // seq_len * seq_len
    total, count = 0.0, 0
    with torch.no_grad():
        windows = tokens[: n + 1]
        starts = list(range(0, n, seq_len))
        for i in range(0, len(starts), batch):
            chunk = starts[i : i + batch]
            x = torch.stack([windows[s : s + seq_len] for s in chunk])
            y = torch.stack([windows[s + 1 : s + seq_len + 1] for s in chunk])
            logits = model(input_ids=x).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
            )
            total += float(loss)
            count += y.numel()
        rest = tokens[n:]
        if len(rest) > 1:  # the tail shorter than a window
            logits = model(input_ids=rest[:-1][None]).logits.float()[0]
            total += float(torch.nn.functional.cross_entropy(logits, rest[1:], reduction="sum"))
            count += len(rest) - 1
    return EvalResult(total / count, count)


def card_file(out: Path, index: int, file, model) -> dict:
    """A held-out file the card records a loss for, copied next to the checkpoint
    (``heldout/``) so that the artifact test can check the loss on any interpreter."""
    import hashlib

    text = file.read()
    sample = f"heldout/{index}-{Path(file.relpath).name}.txt"
    (out / "heldout").mkdir(exist_ok=True)
    (out / sample).write_text(text, encoding="utf-8")
    return {"relpath": file.relpath, "size": file.size, "sample": sample,
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
            **asdict(evaluate_loss(model, tokenize_split("validation", [file])))}


def routing_metrics(model, tokens, top_k: int, seq_len: int = EVAL_SEQ_LEN) -> list[dict]:
    """Per MoE layer, over ``tokens``: mean per-token router entropy (nats), entropy of
    the expert load, and the share of experts that get >= 1 % of the tokens."""
    import torch

    n = (len(tokens) - 1) // seq_len * seq_len
    x = tokens[:n].reshape(-1, seq_len)
    per_layer: list[dict] = []
    with torch.no_grad():
        outs = [model(input_ids=x[i : i + 16], output_router_logits=True).router_logits
                for i in range(0, len(x), 16)]
    num_layers = len(outs[0])
    for layer in range(num_layers):
        logits = torch.cat([o[layer] for o in outs]).float()
        probs = torch.softmax(logits, dim=-1)
        num_experts = probs.shape[-1]
        token_entropy = float(-(probs * probs.clamp_min(1e-12).log()).sum(-1).mean())
        counts = torch.bincount(probs.topk(top_k, -1).indices.reshape(-1), minlength=num_experts)
        share_of_tokens = counts.double() / probs.shape[0]
        load = counts.double() / counts.sum()
        load_entropy = float(-(load[load > 0] * load[load > 0].log()).sum())
        per_layer.append({
            "layer": layer,
            "router_entropy": token_entropy,
            "load_entropy": load_entropy,
            "log_num_experts": math.log(num_experts),
            "experts_used_1pct": float((share_of_tokens >= 0.01).double().mean()),
            "max_expert_share": float(share_of_tokens.max()),
        })
    return per_layer


# ------------------------------------------------------------------------ train


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def train(cfg: TrainConfig, out: Path, command: str) -> dict:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from vllm_specexpert.tools import corpus

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    started = time.time()
    train_tokens = tokenize_split("train")
    val_files = corpus.corpus_files("validation")
    val_tokens = tokenize_split("validation", val_files)
    print(f"corpus: {len(train_tokens):,} train tokens, {len(val_tokens):,} validation tokens")

    model = AutoModelForCausalLM.from_config(cfg.hf_config(), dtype=torch.float32)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "gate.weight" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "gate.weight" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), fused=False,
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    history: list[dict] = []
    bar = tqdm(range(cfg.steps), desc="train-tiny", dynamic_ncols=True)
    window_start, window_tokens = time.perf_counter(), 0
    model.train()
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        starts = torch.randint(0, len(train_tokens) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
        batch = torch.stack([train_tokens[s : s + cfg.seq_len + 1] for s in starts])
        x, y = batch[:, :-1], batch[:, 1:]
        output = model(input_ids=x, output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(
            output.logits.float().reshape(-1, output.logits.shape[-1]), y.reshape(-1)
        )
        balance = balance_loss(output.router_logits, cfg.num_experts_per_tok)
        loss = ce + cfg.balance_coef * balance
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        window_tokens += y.numel()
        if step % 10 == 0 or step == cfg.steps - 1:
            tok_s = window_tokens / (time.perf_counter() - window_start)
            window_start, window_tokens = time.perf_counter(), 0
            history.append({"step": step, "loss": float(ce), "balance": float(balance),
                            "lr": lr_at(step, cfg), "tok_s": tok_s})
            bar.set_postfix(loss=f"{float(ce):.3f}", bal=f"{float(balance):.3f}",
                            tok_s=f"{tok_s:.0f}")
    train_seconds = time.time() - started

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    from vllm_specexpert.tools.fixtures import save_tokenizer

    save_tokenizer(out)

    # Every reported number comes from the saved bf16 checkpoint, as users load it.
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    val = evaluate_loss(model, val_tokens)
    train_eval = evaluate_loss(model, train_tokens[: len(val_tokens)])
    per_file = [card_file(out, i, f, model) for i, f in enumerate(val_files[:CARD_FILES])]
    metrics = {
        "command": command,
        "train_config": asdict(cfg),
        "corpus": corpus.describe(),
        "train_tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "train_corpus_tokens": len(train_tokens),
        "wall_seconds": train_seconds,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_loss": train_eval.loss,
        "validation_loss": val.loss,
        "validation_tokens": val.tokens,
        "validation_perplexity": math.exp(val.loss),
        "validation_unigram_entropy": unigram_entropy(val_tokens),
        "validation_files": per_file,
        "routing": routing_metrics(model, val_tokens, cfg.num_experts_per_tok),
        "samples": greedy_samples(model),
        "torch": torch.__version__,
        "history": history,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    plot_loss(history, out / "loss.png", val.loss)
    (out / "README.md").write_text(model_card(metrics))
    return metrics


def greedy_samples(model, max_new_tokens: int = 48) -> list[dict]:
    import torch

    from vllm_specexpert.tools.fixtures import load_tokenizer

    tokenizer = load_tokenizer()
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=1, eos_token_id=0)
        samples.append({"prompt": prompt, "completion": tokenizer.decode(out[0, ids.shape[1]:].tolist())})
    return samples


def plot_loss(history: list[dict], path: Path, val_loss: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="train (batch)")
    ax.axhline(val_loss, color="C1", linestyle="--", label=f"validation (final) {val_loss:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(0, min(10, max(h["loss"] for h in history)))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def model_card(m: dict) -> str:
    c = m["train_config"]
    rows = "\n".join(
        f"| {r['layer']} | {r['router_entropy']:.2f} | {r['load_entropy']:.2f} | "
        f"{r['log_num_experts']:.2f} | {r['experts_used_1pct']:.0%} | {r['max_expert_share']:.1%} |"
        for r in m["routing"]
    )
    files = "\n".join(f"| `{f['relpath']}` | {f['size']} | {f['tokens']} | {f['loss']:.4f} |"
                      for f in m["validation_files"])
    samples = "\n\n".join(f"```python\n{s['prompt']}{s['completion']}\n```" for s in m["samples"])
    return f"""# tiny-qwen3-moe

A {m['parameters'] / 1e6:.1f} M-parameter Qwen3-MoE ({c['num_hidden_layers']} layers, hidden {c['hidden_size']},
{c['num_experts']} routed experts per layer, top-{c['num_experts_per_tok']}, expert width
{c['moe_intermediate_size']}, tied embeddings, vocab 10,240 byte-level BPE), trained from scratch on
a 2-core CPU on the CPython standard library. It is vllm-specexpert's embedded default model and
the yardstick for its routing predictors. It writes Python-looking text; it is not a useful
code model.

Made by: `{m['command']}` (torch {m['torch']}), in {m['wall_seconds'] / 60:.1f} min wall time.

## Data
{m['corpus']['source']}, `.py` files minus tests, idlelib, lib2to3 and `encodings`; split by
file (sha256 of the relative path, 5 % validation): {m['corpus']['files']['train']} train files
({m['train_corpus_tokens']:,} tokens), {m['corpus']['files']['validation']} validation files
({m['validation_tokens']:,} tokens). Corpus fingerprint (relative paths + sizes):
`{m['corpus']['fingerprint']}`. Tokens seen in training: {m['train_tokens_seen']:,}
({c['steps']} steps x {c['batch_size']} x {c['seq_len']}).

## Results (bf16 checkpoint, fp32 compute, windows of {EVAL_SEQ_LEN} tokens)
| | nats/token |
|---|---|
| validation loss | {m['validation_loss']:.4f} (perplexity {m['validation_perplexity']:.1f}) |
| train loss (first {m['validation_tokens']:,} train tokens) | {m['train_loss']:.4f} |
| unigram entropy of the validation tokens | {m['validation_unigram_entropy']:.4f} |

Per-file validation losses (their text ships in `heldout/`; `tests/test_tiny_model.py` recomputes them with transformers' own loss):

| file | bytes | tokens | loss |
|---|---|---|---|
{files}

## Routing on the validation split
Router entropy: mean over tokens of the entropy of the router's softmax (uniform = log E).
Load entropy: entropy of the distribution of top-k assignments over experts (balanced = log E).
Used: share of experts that receive >= 1 % of the tokens.

| layer | router entropy | load entropy | log E | used | busiest expert |
|---|---|---|---|---|---|
{rows}

![loss](loss.png)

## Greedy samples
{samples}
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=TRAINED_MODEL_DIR)
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--retrain-tokenizer", action="store_true",
                        help="retrain the shared tokenizer on the train split first")


def run(args: argparse.Namespace) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.retrain_tokenizer:
        from vllm_specexpert.tools.fixtures import TOKENIZER_JSON, train_tokenizer

        train_tokenizer(TOKENIZER_JSON)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seed=args.seed)
    command = " ".join(["specexpert", *sys.argv[1:]]) if sys.argv else "specexpert train-tiny"
    metrics = train(cfg, args.out, command)
    print(f"validation loss {metrics['validation_loss']:.4f} nats "
          f"(unigram entropy {metrics['validation_unigram_entropy']:.4f}); wrote {args.out}")
