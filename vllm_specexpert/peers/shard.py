"""A mesh peer's side: the shard of experts it holds and the kernel that computes them.

:class:`ExpertPeer` is the class of a peer's Ray actor (:mod:`.start` makes it remote,
so this module needs no Ray). It reads its experts from the checkpoint on its own node
(never shipped from the engine), in the layout of the engine's slots, and computes
(token, expert) pairs for the rows it is sent: with vLLM's CPU fused-experts kernel
(``cpu_fused_moe``) when the engine runs on the CPU build, else with
:func:`~vllm_specexpert.tiers.host.torch_experts` (on the peer's GPU if it has one: not
run on a GPU yet). The CPU kernel runs with the engine's ISA when the peer's process can
(:func:`runnable_isa`), else with the portable one.

Checkpoint layouts a peer reads: bf16/fp16/fp32 safetensors with one tensor per expert
and projection, named ``{layer}.{e}.gate_proj/up_proj/down_proj.weight`` (Qwen3-MoE,
Qwen2-MoE, OLMoE, DeepSeek-V2) or ``{layer}.{e}.w1/w3/w2.weight`` (Mixtral), where
``{layer}`` is vLLM's name of the layer's experts. :func:`expert_keys` says why another
checkpoint cannot be read.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.peers.ray_cluster import first_line
from vllm_specexpert.tiers.host import torch_experts

if TYPE_CHECKING:
    from safetensors import safe_open

PROJECTIONS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
"""Per-expert tensor names (gate, up, down) of the checkpoint layouts a peer reads."""


@dataclass(frozen=True)
class ShardSpec:
    """What a peer holds and how it computes, sent by the engine at start."""

    checkpoint: str
    """The model directory (the same path on every node)."""
    layers: dict[int, tuple[str, tuple[int, ...]]]
    """Decoder-layer index -> (vLLM's name of its experts, the expert ids this peer holds)."""
    w13_shape: tuple[int, int]
    """One expert's ``[2 * I_padded, H]`` in the engine's slots (vLLM pads I on CPU)."""
    isa: str | None
    """The ISA of vLLM's CPU kernel the engine runs (``None``: :func:`torch_experts`);
    the peer runs :func:`runnable_isa` of it."""
    activation: str = "silu"


PORTABLE_ISA = "vec"
"""vLLM's CPU MoE kernel without AMX tiles (AVX2/AVX-512). Its alignment (32 output
channels) divides AMX's, so it runs on weights padded for AMX."""


def runnable_isa(isa: str | None) -> str | None:
    """The ISA this process runs vLLM's CPU MoE kernel with when the engine runs ``isa``.
    Linux hands a process AMX tile state only on request (``arch_prctl``), and the first
    AMX instruction without it is a SIGILL. vLLM's worker has it by the time its kernel
    runs; a peer's fresh process has not, so it asks (``torch.cpu._init_amx``) and runs
    the portable kernel where the request is refused (a CPU or kernel without AMX)."""
    if isa == "amx" and not torch.cpu._init_amx():
        return PORTABLE_ISA
    return isa


def checkpoint_files(checkpoint: str) -> list[Path]:
    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {checkpoint}")
    return files


def expert_keys(names: set[str] | dict[str, Path], layer: str, expert: int) -> tuple[str, str, str]:
    """The (gate, up, down) tensor names of one expert among the checkpoint's ``names``;
    ``KeyError`` naming what was looked for when the layout is not one a peer reads."""
    for projections in PROJECTIONS:
        gate, up, down = (f"{layer}.{expert}.{p}.weight" for p in projections)
        if all(k in names for k in (gate, up, down)):
            return gate, up, down
    raise KeyError(
        f"{layer}.{expert}.gate_proj.weight (or .w1.weight) is not in the "
        "checkpoint: a peer reads per-expert bf16 tensors only (no fused or "
        "quantized experts)"
    )


def checkpoint_key_index(checkpoint: str) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    from safetensors import safe_open

    index: dict[str, Path] = {}
    for path in checkpoint_files(checkpoint):
        with safe_open(path, "pt") as f:
            index.update(dict.fromkeys(f.keys(), path))
    return index


class ExpertPeer:
    """One peer: its shard of every MoE layer's experts, computed on request."""

    def __init__(self, rank: int, spec: ShardSpec) -> None:
        started = time.perf_counter()
        self.rank = rank
        self.spec = spec
        self.isa = runnable_isa(spec.isa)
        if self.isa is not None:
            from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

            self._fused_moe, prepack = cpu_fused_moe, cpu_prepack_moe_weight
        self.local: dict[int, np.ndarray] = {}
        """Layer -> ``[E]`` position of each global expert id in this shard (-1: not here)."""
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        index = checkpoint_key_index(spec.checkpoint)
        from safetensors import safe_open

        handles = {path: safe_open(path, "pt") for path in set(index.values())}
        for layer, (name, experts) in spec.layers.items():
            w13, w2 = self._read(handles, index, name, experts)
            if self.isa is not None:
                w13, w2 = prepack(w13, self.isa), prepack(w2, self.isa)
            self.tensors[layer] = {"w13_weight": w13, "w2_weight": w2}
            local = np.full(max(experts) + 1, -1, dtype=np.int64)
            local[list(experts)] = np.arange(len(experts))
            self.local[layer] = local
        self.load_seconds = time.perf_counter() - started
        self._kernel_lock = threading.Lock()
        """The actor takes two calls at once (the next rows arrive while the current ones
        compute), but vLLM's CPU kernel shares its scratch space between calls: two
        computing together corrupted each other's output (measured). One at a time."""

    def _read(
        self,
        handles: dict[Path, safe_open],
        index: dict[str, Path],
        name: str,
        experts: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, 2I_pad, H]`` and ``[n, H, I_pad]`` of ``experts``, zero-padded like the
        engine's slots."""
        padded, hidden = self.spec.w13_shape[0] // 2, self.spec.w13_shape[1]
        w13 = torch.zeros(len(experts), 2 * padded, hidden, dtype=torch.bfloat16)
        w2 = torch.zeros(len(experts), hidden, padded, dtype=torch.bfloat16)
        for i, expert in enumerate(experts):
            gate, up, down = (
                handles[index[k]].get_tensor(k) for k in expert_keys(index, name, expert)
            )
            inter = gate.shape[0]
            w13[i, :inter] = gate
            w13[i, padded : padded + inter] = up
            w2[i, :, :inter] = down
        return w13, w2

    def ready(self) -> dict:
        """Where this peer runs and what it holds (the engine's start-up check)."""
        import socket

        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "isa": self.isa,
            "layers": len(self.tensors),
            "load_s": self.load_seconds,
            "experts": sum(len(e) for _, e in self.spec.layers.values()),
        }

    def ping(self) -> int:
        """A probe's answer: the process id (a restarted actor has a new one)."""
        return os.getpid()

    def compute(
        self, layer: int, x: np.ndarray, rows: np.ndarray, experts: np.ndarray
    ) -> tuple[np.ndarray, float]:
        """Expert ``experts[i]``'s output for row ``rows[i]`` of ``x`` (``[R, H]`` bf16
        as int16), unweighted, as ``[N, H]`` bf16 (int16); and the compute seconds."""
        started = time.perf_counter()
        inputs = torch.from_numpy(x).view(torch.bfloat16)[torch.from_numpy(rows)]
        ids = torch.from_numpy(self.local[layer][experts]).to(torch.int32)[:, None]
        if (ids < 0).any():
            raise ValueError(
                f"peer {self.rank} does not hold experts "
                f"{sorted(set(experts[(ids[:, 0] < 0).numpy()].tolist()))} "
                f"of layer {layer}"
            )
        weights = torch.ones(ids.shape, dtype=torch.float32)
        tensors = self.tensors[layer]
        with self._kernel_lock:
            if self.isa is None:
                out = torch_experts(inputs, weights, ids, tensors, self.spec.activation)
            else:
                out = torch.empty_like(inputs)
                self._fused_moe(
                    out,
                    inputs,
                    tensors["w13_weight"],
                    tensors["w2_weight"],
                    None,
                    None,
                    weights,
                    ids,
                    self.spec.activation,
                    self.isa,
                    False,
                )
        return out.view(torch.int16).numpy(), time.perf_counter() - started


PER_EXPERT_KEY = re.compile(r"\.experts\.\d+\.(?:gate_proj|w1)\.weight$")
"""A per-expert tensor of a layout a peer reads (:data:`PROJECTIONS`)."""


def check_checkpoint_layout(checkpoint: str) -> None:
    """Refuse, from the safetensors headers alone (the calling process, before any engine
    starts), a checkpoint without per-expert tensors: fused or quantized experts. The
    layer-by-layer check, :func:`check_checkpoint`, needs vLLM's layer names."""
    if not Path(checkpoint).is_dir():
        return  # not a local directory: the worker's check reads what vLLM loaded
    try:
        index = checkpoint_key_index(checkpoint)
    except (FileNotFoundError, OSError) as error:
        raise _unreadable(first_line(error)) from None
    if not any(PER_EXPERT_KEY.search(key) for key in index):
        raise _unreadable(
            "it has no per-expert tensors (*.experts.N.gate_proj.weight or "
            "*.experts.N.w1.weight): fused or quantized experts"
        )


def check_checkpoint(checkpoint: str, layers: dict[int, tuple[str, tuple[int, ...]]]) -> None:
    """Refuse at start a checkpoint whose experts a peer cannot read (:mod:`.shard`)."""
    try:
        index = checkpoint_key_index(checkpoint)
        for name, experts in layers.values():
            for expert in experts:
                expert_keys(index, name, expert)
    except (KeyError, FileNotFoundError, OSError) as error:
        raise _unreadable(first_line(error)) from None


def _unreadable(problem: str) -> SpecExpertConfigError:
    return SpecExpertConfigError(
        "mesh",
        f"a peer cannot read this model's experts: {problem}",
        "use a bf16 checkpoint with one tensor per expert (Qwen3-MoE, Qwen2-MoE, OLMoE, "
        "DeepSeek-V2, Mixtral), or remove mesh",
    )
