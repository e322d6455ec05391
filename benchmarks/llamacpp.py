"""llama.cpp beside the plugin: a GGUF of a (widened) Qwen3-MoE checkpoint, and greedy
decode of batches of token ids through llama-cpp-python's C API.

Needs ``pip install llama-cpp-python gguf`` (``make bench-disk`` installs both;
llama-cpp-python builds llama.cpp from source for this CPU).

:func:`write_gguf` writes llama.cpp's ``qwen3moe`` layout (experts stacked per layer,
``[E, I, H]`` / ``[E, H, I]``, norms in f32, the rest bf16 as in the checkpoint) straight
from the *trained* checkpoint, padding the experts' intermediate dimension with zeros to
``intermediate`` as ``specexpert widen`` does: the same model as the widened checkpoint,
written without reading 30 GB back from disk. One layer's stacked expert tensor is in
memory at a time. The tokenizer goes in as GPT-2-style byte-level BPE (tokens, merges);
prompts are fed as token ids, so both engines see the same input whatever llama.cpp's
pre-tokenizer would do.
"""

from __future__ import annotations

import ctypes
import json
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open


def storage_read_bytes() -> int:
    """Bytes this process has caused to be read from storage (``/proc/self/io``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _bf16(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def write_gguf(model: Path, out: Path, intermediate: int | None = None) -> int:
    """``model`` (a Qwen3-MoE safetensors checkpoint) as a GGUF at ``out``, experts
    widened to ``intermediate``; returns the bytes written."""
    import gguf

    config = json.loads((model / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names = f.keys()
            for name in names:
                tensors[name] = f.get_tensor(name)
    layers = int(config["num_hidden_layers"])
    experts = int(config.get("num_experts") or config["num_local_experts"])
    hidden = int(config["hidden_size"])
    old = int(config["moe_intermediate_size"])
    new = intermediate or old
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)

    writer = gguf.GGUFWriter(str(out), arch="qwen3moe")
    writer.add_name(model.name)
    writer.add_block_count(layers)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config["num_key_value_heads"]))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_expert_count(experts)
    writer.add_expert_used_count(int(config["num_experts_per_tok"]))
    writer.add_expert_feed_forward_length(new)
    _add_tokenizer(writer, model, config)

    # (name, numpy shape, dtype, source): sources are callables, so that a layer's
    # stacked experts are built only when their turn to be written comes.
    plan: list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, object]] = []

    def plain(gguf_name: str, hf_name: str, f32: bool = False) -> None:
        t = tensors[hf_name]
        kind = gguf.GGMLQuantizationType.F32 if f32 else gguf.GGMLQuantizationType.BF16
        plan.append((gguf_name, tuple(t.shape), kind, lambda: t))

    plain("token_embd.weight", "model.embed_tokens.weight")
    plain("output_norm.weight", "model.norm.weight", f32=True)
    if "lm_head.weight" in tensors and not config.get("tie_word_embeddings"):
        plain("output.weight", "lm_head.weight")
    for i in range(layers):
        hf, blk = f"model.layers.{i}", f"blk.{i}"
        plain(f"{blk}.attn_norm.weight", f"{hf}.input_layernorm.weight", f32=True)
        plain(f"{blk}.attn_q.weight", f"{hf}.self_attn.q_proj.weight")
        plain(f"{blk}.attn_k.weight", f"{hf}.self_attn.k_proj.weight")
        plain(f"{blk}.attn_v.weight", f"{hf}.self_attn.v_proj.weight")
        plain(f"{blk}.attn_output.weight", f"{hf}.self_attn.o_proj.weight")
        plain(f"{blk}.attn_q_norm.weight", f"{hf}.self_attn.q_norm.weight", f32=True)
        plain(f"{blk}.attn_k_norm.weight", f"{hf}.self_attn.k_norm.weight", f32=True)
        plain(f"{blk}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", f32=True)
        plain(f"{blk}.ffn_gate_inp.weight", f"{hf}.mlp.gate.weight")
        for proj, kind in (("gate", "rows"), ("up", "rows"), ("down", "columns")):
            shape = (experts, new, hidden) if kind == "rows" else (experts, hidden, new)

            def stacked(proj=proj, shape=shape, hf=hf) -> torch.Tensor:
                out = torch.zeros(shape, dtype=torch.bfloat16)
                for e in range(experts):
                    w = tensors[f"{hf}.mlp.experts.{e}.{proj}_proj.weight"]
                    out[e, : w.shape[0], : w.shape[1]] = w
                return out

            plan.append(
                (f"{blk}.ffn_{proj}_exps.weight", shape, gguf.GGMLQuantizationType.BF16, stacked)
            )
    for name, shape, kind, _ in plan:
        itemsize = 4 if kind == gguf.GGMLQuantizationType.F32 else 2
        dtype = np.float32 if kind == gguf.GGMLQuantizationType.F32 else np.uint16
        nbytes = int(np.prod(shape)) * itemsize
        writer.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, kind, source in plan:
        t = source()  # type: ignore[operator]
        if kind == gguf.GGMLQuantizationType.F32:
            writer.write_tensor_data(t.float().contiguous().numpy())
        else:
            writer.write_tensor_data(_bf16(t))
        del t
    writer.close()
    return out.stat().st_size


def _add_tokenizer(writer, model: Path, config: dict) -> None:
    """The byte-level BPE of ``tokenizer.json`` (the model's, or the embedded one)."""
    import gguf

    path = model / "tokenizer.json"
    if not path.exists():
        from vllm_specexpert.tools.embedded_model import TOKENIZER_JSON

        path = TOKENIZER_JSON
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    tokens = [""] * int(config["vocab_size"])
    types = [gguf.TokenType.UNUSED] * len(tokens)
    for token, index in vocab.items():
        tokens[index] = token
        types[index] = gguf.TokenType.NORMAL
    for added in spec.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = (
            gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
        )
    for index, token in enumerate(tokens):
        if not token:
            tokens[index] = f"[PAD{index}]"
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(int(config["bos_token_id"]))
    writer.add_eos_token_id(int(config["eos_token_id"]))
    if config.get("pad_token_id") is not None:
        writer.add_pad_token_id(int(config["pad_token_id"]))
    writer.add_add_bos_token(False)


class LlamaCppDecoder:
    """One llama.cpp model and context through the C API (llama-cpp-python's ``Llama``
    does not pass ``n_seq_max``), decoding batches of sequences greedily from token ids
    (``llama_decode`` on a ``llama_batch``, argmax of the logits). The model is loaded
    with llama.cpp's defaults (``load_mode`` auto: mmap)."""

    def __init__(self, gguf_path: Path, n_ctx: int, n_seq_max: int, n_threads: int) -> None:
        import llama_cpp

        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(
            str(gguf_path).encode(), llama_cpp.llama_model_default_params()
        )
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = n_seq_max
        params.n_threads = params.n_threads_batch = n_threads
        self.n_batch = 512
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make a context")
        self.n_threads = n_threads
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))

    def close(self) -> None:
        import llama_cpp

        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    def generate(self, prompts: list[list[int]], tokens: int) -> dict:
        """Greedy ``tokens`` tokens for every prompt at once: the prefill's seconds, each
        decode step's, the tokens, and the bytes this process read from storage while
        it decoded (page faults of the mmap)."""
        import llama_cpp

        ctx = self.ctx
        memory = llama_cpp.llama_get_memory(ctx)
        llama_cpp.llama_memory_clear(memory, True)
        n = len(prompts)
        total = sum(len(p) for p in prompts)
        batch = llama_cpp.llama_batch_init(max(total, n), 0, n)
        try:
            start = time.perf_counter()
            nxt = self._prefill(batch, prompts)
            prefill_s = time.perf_counter() - start
            read_after_prefill = storage_read_bytes()
            out = [[t] for t in nxt]
            steps = []
            positions = [len(p) for p in prompts]
            for _ in range(tokens - 1):
                start = time.perf_counter()
                batch.n_tokens = n
                for s in range(n):
                    self._put(batch, s, out[s][-1], positions[s], s, True)
                    positions[s] += 1
                self._decode(batch)
                for s in range(n):
                    out[s].append(self._argmax(s))
                steps.append(time.perf_counter() - start)
        finally:
            llama_cpp.llama_batch_free(batch)
        return {
            "prefill_s": prefill_s,
            "step_s": steps,
            "tokens": out,
            "decode_read_bytes": storage_read_bytes() - read_after_prefill,
        }

    def _prefill(self, batch, prompts: list[list[int]]) -> list[int]:
        """Every prompt in chunks of at most ``n_batch`` tokens; each prompt's greedy next
        token (read right after the chunk that held its last token)."""
        flat = [(s, pos, t) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
        size = self.n_batch
        last = [0] * len(prompts)
        for at in range(0, len(flat), size):
            chunk = flat[at : at + size]
            batch.n_tokens = len(chunk)
            for i, (s, pos, t) in enumerate(chunk):
                final = pos == len(prompts[s]) - 1
                self._put(batch, i, t, pos, s, final)
            self._decode(batch)
            for i, (s, pos, _) in enumerate(chunk):
                if pos == len(prompts[s]) - 1:
                    last[s] = self._argmax(i)
        return last

    @staticmethod
    def _put(batch, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits

    def _decode(self, batch) -> None:
        import llama_cpp

        status = llama_cpp.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def _argmax(self, i: int) -> int:
        import llama_cpp

        pointer = llama_cpp.llama_get_logits_ith(self.ctx, i)
        logits = np.ctypeslib.as_array(
            ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), (self.vocab,)
        )
        return int(logits.argmax())
