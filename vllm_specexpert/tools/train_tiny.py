"""Train the embedded default model: a small Qwen3-MoE with many experts and learned routing.

    specexpert train-tiny [--out DIR] [--steps N] [--retrain-tokenizer]

A decoder-only MoE in the Hugging Face Qwen3-MoE format (8 layers, 64 routed experts per
layer, top-4), trained from scratch on this machine's 2-core CPU on the Python corpus of
:mod:`vllm_specexpert.tools.corpus` (this environment's site-packages and the stdlib, about
53 M tokens), so the project has a model whose router has learned something without
downloading one. Every training window is a distinct, non-overlapping slice of the train
split: no token is seen twice. The run is seeded and reproducible for a given corpus
fingerprint and torch build; it writes the checkpoint (bf16 safetensors, tokenizer),
``metrics.json``, ``loss.png``, the held-out text the card's losses are measured on
(``heldout/``) and a model card ``README.md`` with the command, corpus, wall time,
tokens/s, losses against unigram entropies, per-layer routing statistics and samples.

Routing is trained with a per-layer load-balancing loss (Switch Transformer's
``E * sum_e f_e * P_e``, averaged over layers), so that every layer spreads its tokens
over its experts. The experts run as one padded batched matmul per layer
(:func:`padded_bmm_experts_forward`, registered as transformers' experts implementation
``padded_bmm`` for training only) under ``torch.compile``: about 1.4x the throughput of
transformers' per-expert loop here; the saved checkpoint is plain Qwen3-MoE.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_specexpert.tools.demo import PROMPTS as SAMPLE_PROMPTS
from vllm_specexpert.tools.demo import REPETITION_PENALTY
from vllm_specexpert.tools.embedded_model import TRAINED_MODEL_DIR

EVAL_SEQ_LEN = 256
EVAL_WINDOWS = 512
"""Windows of EVAL_SEQ_LEN tokens the full-split losses are measured on (spread evenly)."""
HELDOUT_BYTES = 150_000
"""Size of each shipped held-out sample (validation, test packages)."""


@dataclass(frozen=True)
class TrainConfig:
    """Shape and schedule. The defaults are what the committed model was trained with."""

    num_hidden_layers: int = 8
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_experts: int = 64
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 64
    seq_len: int = 256
    batch_size: int = 16
    """Sequences per optimizer step."""
    steps: int = 1600
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    balance_coef: float = 0.01
    """Weight of each layer's load-balancing loss (Switch Transformer's alpha)."""
    capacity_factor: float = 1.5
    """Padded experts: slots per expert = this x the mean load (overflow runs apart)."""
    max_minutes: float = 88.0
    """Training stops here even if ``steps`` are not done (the 90-minute budget)."""
    seed: int = 0
    threads: int = 2

    def hf_config(self):
        from transformers import Qwen3MoeConfig

        from vllm_specexpert.tools.embedded_model import VOCAB_SIZE

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


# ---------------------------------------------------------------------- experts


def padded_bmm_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Qwen3-MoE experts as one padded batched matmul: (token, expert) pairs sorted by
    expert into ``[E, capacity, H]`` (capacity = ``CAPACITY_FACTOR`` x the mean load),
    two ``bmm``; pairs beyond an expert's capacity run per expert, so nothing is dropped
    and the result equals the per-expert loop's (``tests/test_train_tiny.py``)."""
    import torch

    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[1]
    num_experts = self.num_experts
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    expert_sorted = flat[order]
    counts = torch.bincount(flat, minlength=num_experts)
    capacity = max(1, min(int(counts.max()), int(CAPACITY_FACTOR * flat.numel() / num_experts) + 1))
    starts = torch.cumsum(counts, 0) - counts
    within = torch.arange(flat.numel(), device=flat.device) - torch.repeat_interleave(
        starts, counts
    )
    token_of = order // top_k
    weights = top_k_weights.reshape(-1)[order]
    fits = within < capacity
    slot = (expert_sorted * capacity + within)[fits]
    x = hidden_states.new_zeros(num_experts * capacity, hidden).index_put(
        (slot,), hidden_states[token_of[fits]]
    )
    h = self._apply_gate(
        torch.bmm(x.view(num_experts, capacity, hidden), self.gate_up_proj.transpose(1, 2))
    )
    y = torch.bmm(h, self.down_proj.transpose(1, 2)).view(num_experts * capacity, hidden)[slot]
    out = hidden_states.new_zeros(tokens, hidden).index_add(
        0, token_of[fits], y * weights[fits, None].to(y.dtype)
    )
    if not bool(fits.all()):
        over = ~fits
        for expert in torch.unique(expert_sorted[over]).tolist():
            chosen = over & (expert_sorted == expert)
            rows = token_of[chosen]
            he = self._apply_gate(
                torch.nn.functional.linear(hidden_states[rows], self.gate_up_proj[expert])
            )
            ye = torch.nn.functional.linear(he, self.down_proj[expert])
            out = out.index_add(0, rows, ye * weights[chosen, None].to(ye.dtype))
    return out


CAPACITY_FACTOR = TrainConfig.capacity_factor


def register_padded_experts() -> None:
    """Make ``padded_bmm`` a transformers experts implementation (training only)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register("padded_bmm", padded_bmm_experts_forward)


# ------------------------------------------------------------------------- data


def split_tokens(split: str):
    """The corpus split as a 1-D int64 tensor (every file followed by EOS)."""
    import numpy as np
    import torch

    from vllm_specexpert.tools import corpus
    from vllm_specexpert.tools.embedded_model import TOKENIZER_JSON

    return torch.from_numpy(np.asarray(corpus.tokens(split, TOKENIZER_JSON), dtype=np.int64))


def spread_windows(tokens, count: int, length: int = EVAL_SEQ_LEN):
    """``count`` windows of ``length + 1`` tokens spread evenly over ``tokens``."""
    import torch

    last = len(tokens) - length - 1
    starts = torch.linspace(0, last, count).long()
    return torch.stack([tokens[s : s + length + 1] for s in starts])


def unigram_entropy(tokens) -> float:
    """Entropy (nats) of the token frequency distribution: the loss of the best model
    that ignores context."""
    import torch

    counts = torch.bincount(tokens.reshape(-1)).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def heldout_sample(split: str, budget: int = HELDOUT_BYTES) -> tuple[str, list[str]]:
    """Text shipped with the model for the card's checks: whole files of ``split``,
    round-robin over its packages (one file each, largest package first), until
    ``budget`` bytes. Returns (text with EOS-separated files, their paths)."""
    from vllm_specexpert.tools import corpus

    by_package: dict[str, list] = {}
    for f in corpus.corpus_files(split):
        if 1_000 <= f.size <= budget // 3:
            by_package.setdefault(f.package, []).append(f)
    queues = sorted(by_package.values(), key=lambda fs: -sum(f.size for f in fs))
    chosen, size = [], 0
    while queues and size < budget:
        for files in list(queues):
            if not files:
                queues.remove(files)
                continue
            f = files.pop(len(files) // 2)  # a file from the middle: not always __init__
            if size + f.size > budget:
                continue
            chosen.append(f)
            size += f.size
    return "<|endoftext|>".join(f.read() for f in chosen) + "<|endoftext|>", [
        f.relpath for f in chosen
    ]


# ----------------------------------------------------------------------- losses


def balance_loss(router_logits, top_k: int):
    """Switch-style load balancing, summed over layers: each layer feels the full
    coefficient, whatever the depth (averaged over 8 layers, a first run left one
    expert of layer 0 at 1 % of its fair share)."""
    import torch

    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        num_experts = probs.shape[-1]
        chosen = probs.topk(top_k, dim=-1).indices
        fraction = torch.bincount(chosen.reshape(-1), minlength=num_experts).float()
        fraction = fraction / chosen.numel()
        losses.append(num_experts * (fraction * probs.mean(0)).sum())
    return torch.stack(losses).sum()


@dataclass
class EvalResult:
    loss: float
    tokens: int


def evaluate_loss(model, windows, batch: int = 16) -> EvalResult:
    """Mean next-token NLL over ``windows`` ([N, L + 1]: each predicts its tokens 1..L
    from its own prefix)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            chunk = windows[i : i + batch]
            logits = model(input_ids=chunk[:, :-1]).logits.float()
            total += float(
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"
                )
            )
            count += chunk[:, 1:].numel()
    return EvalResult(total / count, count)


def text_windows(text: str, length: int = EVAL_SEQ_LEN):
    """A held-out text as windows of ``length + 1`` tokens (stride ``length``: every token
    but the first predicted once; the tail window may be shorter and is dropped)."""
    import torch

    from vllm_specexpert.tools.embedded_model import load_tokenizer

    ids = torch.tensor(load_tokenizer().encode(text).ids)
    n = (len(ids) - 1) // length
    return torch.stack([ids[i * length : i * length + length + 1] for i in range(n)])


def routing_metrics(model, windows) -> list[dict]:
    """Per MoE layer, over ``windows``: mean per-token router entropy (nats) and its
    ratio to log E, entropy of the expert load, and each expert's share of the top-k
    assignments relative to a fair share (min, max)."""
    import torch

    with torch.no_grad():
        outs = [
            model(input_ids=windows[i : i + 16, :-1], output_router_logits=True).router_logits
            for i in range(0, len(windows), 16)
        ]
    top_k = model.config.num_experts_per_tok
    per_layer: list[dict] = []
    for layer in range(len(outs[0])):
        probs = torch.softmax(torch.cat([o[layer] for o in outs]).float(), dim=-1)
        num_experts = probs.shape[-1]
        token_entropy = float(-(probs * probs.clamp_min(1e-12).log()).sum(-1).mean())
        counts = torch.bincount(probs.topk(top_k, -1).indices.reshape(-1), minlength=num_experts)
        load = counts.double() / counts.sum()
        fair = load * num_experts
        per_layer.append(
            {
                "layer": layer,
                "router_entropy": token_entropy,
                "router_entropy_ratio": token_entropy / math.log(num_experts),
                "load_entropy": float(-(load[load > 0] * load[load > 0].log()).sum()),
                "log_num_experts": math.log(num_experts),
                "min_fair_share": float(fair.min()),
                "max_fair_share": float(fair.max()),
            }
        )
    return per_layer


# ------------------------------------------------------------------------ train


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def train(cfg: TrainConfig, out: Path, command: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_specexpert.tools import corpus
    from vllm_specexpert.tools.progress import progress_bar

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    train_tokens = split_tokens("train")
    window = cfg.seq_len + 1
    # Distinct, non-overlapping windows in a seeded order: no token is seen twice.
    gen = torch.Generator().manual_seed(cfg.seed)
    starts = torch.randperm(len(train_tokens) // window, generator=gen) * window
    needed = cfg.steps * cfg.batch_size
    if needed > len(starts):
        raise SystemExit(f"{needed} windows needed, the train split has {len(starts)}")
    print(
        f"corpus: {len(train_tokens):,} train tokens; this run sees "
        f"{needed * cfg.seq_len:,} of them, each once",
        flush=True,
    )

    register_padded_experts()
    config = cfg.hf_config()
    config._experts_implementation = "padded_bmm"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "gate.weight" not in n]
    no_decay = [
        p for n, p in model.named_parameters() if not (p.dim() >= 2 and "gate.weight" not in n)
    ]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        fused=True,
    )
    forward = torch.compile(model, dynamic=True)
    history: list[dict] = []
    started = time.time()
    bar = progress_bar("train-tiny", iterable=range(cfg.steps), unit="step")
    window_start, window_tokens, steps_done = time.perf_counter(), 0, 0
    model.train()
    for step in bar:
        if (time.time() - started) / 60 > cfg.max_minutes:
            print(f"stopping at step {step}: the {cfg.max_minutes}-minute budget is spent")
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch_starts = starts[step * cfg.batch_size : (step + 1) * cfg.batch_size]
        batch = torch.stack([train_tokens[s : s + window] for s in batch_starts])
        output = forward(input_ids=batch[:, :-1], output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(
            output.logits.float().reshape(-1, output.logits.shape[-1]), batch[:, 1:].reshape(-1)
        )
        balance = balance_loss(output.router_logits, cfg.num_experts_per_tok)
        loss = ce + cfg.balance_coef * balance
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        window_tokens += batch[:, 1:].numel()
        steps_done = step + 1
        if step % 20 == 0 or step == cfg.steps - 1:
            tok_s = window_tokens / (time.perf_counter() - window_start)
            window_start, window_tokens = time.perf_counter(), 0
            history.append(
                {
                    "step": step,
                    "loss": float(ce),
                    "balance": float(balance),
                    "lr": lr_at(step, cfg),
                    "tok_s": tok_s,
                }
            )
            bar.set_postfix(
                loss=f"{float(ce):.3f}",
                bal=f"{float(balance):.3f}",
                tok_s=f"{tok_s:.0f}",
                refresh=False,
            )
    bar.close()
    train_seconds = time.time() - started
    tokens_seen = steps_done * cfg.batch_size * cfg.seq_len

    out.mkdir(parents=True, exist_ok=True)
    model.config._experts_implementation = None
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    from vllm_specexpert.tools.embedded_model import save_tokenizer

    save_tokenizer(out)
    metrics = evaluate(
        out,
        command,
        {
            "train_config": asdict(cfg),
            "corpus": corpus.describe(),
            "train_corpus_tokens": len(train_tokens),
            "steps_done": steps_done,
            "train_tokens_seen": tokens_seen,
            "train_seconds": train_seconds,
            "train_tokens_per_second": tokens_seen / train_seconds,
            "history": history,
            "train_windows": starts[:needed],
        },
        train_tokens,
    )
    plot_loss(history, out / "loss.png", metrics["validation"]["loss"])
    return metrics


def evaluate(out: Path, command: str, run: dict, train_tokens) -> dict:
    """Every reported number, from the saved bf16 checkpoint as users load it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    train_windows = run.pop("train_windows")
    seen = torch.stack(
        [train_tokens[s : s + EVAL_SEQ_LEN + 1] for s in train_windows[:EVAL_WINDOWS]]
    )
    splits = {"train (seen windows)": seen}
    for split in ("validation", "test"):
        splits[split] = spread_windows(split_tokens(split), EVAL_WINDOWS)
    losses = {}
    for name, windows in splits.items():
        result = evaluate_loss(model, windows)
        losses[name] = {
            "loss": result.loss,
            "tokens": result.tokens,
            "unigram_entropy": unigram_entropy(windows[:, 1:]),
        }
    heldout = {}
    shutil.rmtree(out / "heldout", ignore_errors=True)  # no stale samples of an older model
    (out / "heldout").mkdir()
    for split in ("validation", "test"):
        text, files = heldout_sample(split)
        path = f"heldout/{split}.txt"
        (out / path).write_text(text, encoding="utf-8")
        windows = text_windows(text)
        result = evaluate_loss(model, windows)
        heldout[split] = {
            "sample": path,
            "files": files,
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "loss": result.loss,
            "tokens": result.tokens,
            "unigram_entropy": unigram_entropy(windows[:, 1:]),
        }
    heldout_routing = routing_metrics(
        model, text_windows((out / heldout["validation"]["sample"]).read_text(encoding="utf-8"))
    )
    metrics = {
        "command": command,
        **run,
        "parameters": sum(p.numel() for p in model.parameters()),
        "checkpoint_bytes": sum(p.stat().st_size for p in out.glob("*.safetensors")),
        "validation": losses["validation"],
        "test": losses["test"],
        "train": losses["train (seen windows)"],
        "heldout": heldout,
        "routing": routing_metrics(model, splits["validation"][:128]),
        "gates": quality_gates(heldout, heldout_routing),
        "samples": greedy_samples(model),
        "torch": torch.__version__,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    (out / "README.md").write_text(model_card(metrics))
    return metrics


def quality_gates(heldout: dict, routing: list[dict]) -> list[dict]:
    """The model's quality gates on the shipped held-out samples, as
    ``tests/test_tiny_model.py`` checks them (there recomputed with transformers' loss)."""
    test = heldout["test"]
    gates = [
        (
            "test-package loss / unigram entropy (`heldout/test.txt`)",
            test["loss"] / test["unigram_entropy"],
            "< 0.6",
            test["loss"] < 0.6 * test["unigram_entropy"],
        ),
        (
            "router entropy / log E, worst layer (`heldout/validation.txt`)",
            max(r["router_entropy_ratio"] for r in routing),
            "< 0.9",
            all(r["router_entropy_ratio"] < 0.9 for r in routing),
        ),
        (
            "least-used expert's share of its fair share, worst layer (`heldout/validation.txt`)",
            min(r["min_fair_share"] for r in routing),
            ">= 0.1",
            all(r["min_fair_share"] >= 0.1 for r in routing),
        ),
    ]
    return [
        {"gate": name, "value": value, "limit": limit, "passed": passed}
        for name, value, limit, passed in gates
    ]


def greedy_samples(model, max_new_tokens: int = 64) -> list[dict]:
    import torch

    from vllm_specexpert.tools.embedded_model import load_tokenizer

    tokenizer = load_tokenizer()
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                repetition_penalty=REPETITION_PENALTY,
                pad_token_id=1,
                eos_token_id=0,
            )
        samples.append(
            {"prompt": prompt, "completion": tokenizer.decode(out[0, ids.shape[1] :].tolist())}
        )
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
    corpus = m["corpus"]
    rows = "\n".join(
        f"| {r['layer']} | {r['router_entropy']:.2f} | {r['router_entropy_ratio']:.2f} | "
        f"{r['load_entropy']:.2f} | {r['log_num_experts']:.2f} | {r['min_fair_share']:.2f} | "
        f"{r['max_fair_share']:.2f} |"
        for r in m["routing"]
    )
    samples = "\n\n".join(f"```python\n{s['prompt']}{s['completion']}\n```" for s in m["samples"])
    largest = ", ".join(
        f"{k} {v / 1e6:.1f} MB" for k, v in corpus["largest_train_packages"].items()
    )
    gate_rows = "\n".join(
        f"| {g['gate']} | {g['value']:.3f} | {g['limit']} | {'yes' if g['passed'] else '**NO**'} |"
        for g in m["gates"]
    )

    def loss_row(name: str, r: dict) -> str:
        return (
            f"| {name} | {r['loss']:.4f} | {r['unigram_entropy']:.4f} | "
            f"{r['loss'] / r['unigram_entropy']:.3f} | {r['tokens']:,} |"
        )

    return f"""# tiny-qwen3-moe

A {m["parameters"] / 1e6:.1f} M-parameter Qwen3-MoE ({c["num_hidden_layers"]} layers, hidden
{c["hidden_size"]}, {c["num_experts"]} routed experts per layer, top-{c["num_experts_per_tok"]},
expert width {c["moe_intermediate_size"]}, tied embeddings, vocab 10,240 byte-level BPE;
{m["checkpoint_bytes"] / 1e6:.1f} MB in bf16), trained from scratch on a 2-core CPU on Python
source code. It is vllm-specexpert's embedded default model and the yardstick for its routing
predictors and expert scheduling. It writes Python-looking code; it is not a useful code model.

Made by: `{m["command"]}` (torch {m["torch"]}): {m["steps_done"]} steps of
{c["batch_size"]} x {c["seq_len"]} tokens in {m["train_seconds"] / 60:.1f} min of training,
{m["train_tokens_per_second"]:.0f} tokens/s.

## Data
{corpus["source"]} ({corpus["train_packages"]} training packages; largest: {largest}).
Filtered and deduplicated as `specexpert corpus` documents (tests, vendored copies, generated
files and files over 1 MB dropped). Splits by sha256: the package-level **test** split holds
whole packages never trained on: {", ".join(corpus["test_packages"])}
({corpus["files"]["test"]} files, {corpus["bytes"]["test"] / 1e6:.1f} MB); **validation** is 2 %
of the other files ({corpus["files"]["validation"]} files); **train** the rest
({corpus["files"]["train"]} files, {corpus["bytes"]["train"] / 1e6:.1f} MB,
{m["train_corpus_tokens"]:,} tokens). Corpus fingerprint: `{corpus["fingerprint"]}`.
Tokens seen in training: {m["train_tokens_seen"]:,}, each once (distinct non-overlapping
windows).

## Results (bf16 checkpoint, fp32 compute, {EVAL_WINDOWS} windows of {EVAL_SEQ_LEN} tokens spread over each split)
| split | loss (nats/token) | unigram entropy of the same tokens | ratio | tokens |
|---|---|---|---|---|
{loss_row("train (windows it was trained on)", m["train"])}
{loss_row("validation", m["validation"])}
{loss_row("test (held-out packages)", m["test"])}

Shipped held-out samples (`heldout/`, whole files; `tests/test_tiny_model.py` recomputes these
with transformers' own loss, under `make test-slow`, and checks the quality gates on them):
{loss_row_table(m["heldout"])}

Quality gates, on the shipped samples (mean per-token router entropy below 0.9 x log E and every
expert at least 10 % of its fair share of the top-k assignments, in every layer):
| gate | value | limit | passed |
|---|---|---|---|
{gate_rows}

## Routing on the validation split
Router entropy: mean over tokens of the entropy of the router's softmax (uniform = log E).
Load entropy: entropy of the distribution of top-k assignments over experts (balanced = log E).
Fair share: an expert's share of the assignments x E (1.0 = perfectly balanced).

| layer | router entropy | / log E | load entropy | log E | min fair share | max fair share |
|---|---|---|---|---|---|---|
{rows}

![loss](loss.png)

## Greedy samples (repetition penalty {REPETITION_PENALTY})
{samples}
"""


def loss_row_table(heldout: dict) -> str:
    lines = [
        "| sample | files | loss | unigram entropy | ratio | tokens |",
        "|---|---|---|---|---|---|",
    ]
    lines.extend(
        f"| `{r['sample']}` | {len(r['files'])} | {r['loss']:.4f} | "
        f"{r['unigram_entropy']:.4f} | {r['loss'] / r['unigram_entropy']:.3f} | "
        f"{r['tokens']:,} |"
        for r in heldout.values()
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vllm_specexpert.tools.arguments import positive_float, positive_int

    parser.add_argument("--out", type=Path, default=TRAINED_MODEL_DIR)
    parser.add_argument("--steps", type=positive_int, default=TrainConfig.steps)
    parser.add_argument("--batch-size", type=positive_int, default=TrainConfig.batch_size)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--max-minutes", type=positive_float, default=TrainConfig.max_minutes)
    parser.add_argument(
        "--retrain-tokenizer",
        action="store_true",
        help="retrain the shared tokenizer on the train split first",
    )


def run(args: argparse.Namespace) -> None:
    from vllm_specexpert.tools.arguments import check_output_dir, holding

    check_output_dir(args.out, "--out", holding("metrics.json"), "a model of train-tiny")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.retrain_tokenizer:
        from vllm_specexpert.tools.embedded_model import TOKENIZER_JSON, train_tokenizer

        train_tokenizer(TOKENIZER_JSON)
    cfg = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seed=args.seed, max_minutes=args.max_minutes
    )
    command = " ".join(["specexpert", *sys.argv[1:]]) if sys.argv else "specexpert train-tiny"
    metrics = train(cfg, args.out, command)
    v, t = metrics["validation"], metrics["test"]
    print(
        f"validation loss {v['loss']:.4f} (unigram {v['unigram_entropy']:.4f}), test-package "
        f"loss {t['loss']:.4f} (unigram {t['unigram_entropy']:.4f}); wrote {args.out}"
    )
    failed = [g["gate"] for g in metrics["gates"] if not g["passed"]]
    if failed:
        print("quality gates NOT passed (see the model card): " + "; ".join(failed))
        sys.exit(1)
