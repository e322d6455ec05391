"""One routed expert's tensors read straight from a Hugging Face safetensors checkpoint,
in vLLM's fused layout (``w13_weight`` = gate and up stacked, ``w2_weight`` = down): the
source an expert pack is written from (:func:`~.expert_pack.write_pack`), one expert at
a time, without loading the model.

bf16/fp16/fp32 checkpoints whose experts are stored one tensor per projection (Qwen2/3-
MoE, OLMoE, DeepSeek-V2, Mixtral). Fused-expert checkpoints (GPT-OSS) and quantized ones
are not read here.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

PROJECTIONS: dict[str, tuple[str, str, str]] = {
    "Qwen3MoeForCausalLM": ("gate_proj", "up_proj", "down_proj"),
    "Qwen2MoeForCausalLM": ("gate_proj", "up_proj", "down_proj"),
    "OlmoeForCausalLM": ("gate_proj", "up_proj", "down_proj"),
    "DeepseekV2ForCausalLM": ("gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": ("w1", "w3", "w2"),
}
"""Per architecture, the checkpoint names of an expert's gate, up and down projections
(``{layer}.{expert}.{name}.weight``)."""
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
"""The safetensors dtypes read here."""
TensorSpec = tuple[str, tuple[int, ...], torch.dtype]
"""A tensor's name, shape and dtype."""


class CheckpointExperts:
    """Experts of the checkpoint in ``model_dir``, by vLLM layer name and expert id."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        config = json.loads((self.model_dir / "config.json").read_text())
        architecture = (config.get("architectures") or ["?"])[0]
        if architecture not in PROJECTIONS:
            raise ValueError(
                f"{model_dir}: {architecture} checkpoints are not read expert by expert "
                f"(readable: {', '.join(PROJECTIONS)})"
            )
        if config.get("quantization_config"):
            raise ValueError(
                f"{model_dir}: a quantized checkpoint; its experts are not read expert by "
                "expert here yet (give its bf16 checkpoint)"
            )
        self.projections = PROJECTIONS[architecture]
        self._files: dict[str, Any] = {}
        self._where = self._index()

    def _index(self) -> dict[str, str]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.exists():
            return dict(json.loads(index.read_text())["weight_map"])
        where = {}
        for path in sorted(self.model_dir.glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                where.update(dict.fromkeys(f.keys(), path.name))
        return where

    def _handle(self, file: str) -> Any:
        handle = self._files.get(file)
        if handle is None:
            handle = self._files[file] = safe_open(str(self.model_dir / file), "pt")
        return handle

    def _tensor(self, key: str) -> torch.Tensor:
        file = self._where.get(key)
        if file is None:
            raise KeyError(f"{self.model_dir}: no tensor {key}")
        return self._handle(file).get_tensor(key)

    def __call__(self, layer: str, expert: int) -> dict[str, torch.Tensor]:
        """``{"w13_weight": [2I, H], "w2_weight": [H, I]}`` of ``expert`` of vLLM layer
        ``layer`` (e.g. ``model.layers.3.mlp.experts``)."""
        gate, up, down = (self._tensor(f"{layer}.{expert}.{p}.weight") for p in self.projections)
        return {"w13_weight": torch.cat([gate, up]), "w2_weight": down}

    def layers(self) -> list[tuple[str, int]]:
        """Each MoE layer's vLLM name (its experts' checkpoint prefix, e.g.
        ``model.layers.3.mlp.experts``) and expert count, in decoder-layer order."""
        pattern = re.compile(rf"^(.*)\.\d+\.{re.escape(self.projections[0])}\.weight$")
        counts = Counter(m.group(1) for key in self._where if (m := pattern.match(key)))

        def index(name: str) -> tuple[int, str]:
            found = re.search(r"layers\.(\d+)\.", name)
            return (int(found.group(1)) if found else -1, name)

        return [(name, counts[name]) for name in sorted(counts, key=index)]

    def tensor_specs(self, layer: str) -> list[TensorSpec]:
        """The name, shape and dtype of each tensor :meth:`__call__` gives for an expert of
        ``layer``, from the checkpoint's headers (nothing read)."""
        gate, up, down = (self._spec(f"{layer}.0.{p}.weight") for p in self.projections)
        if gate[1] != up[1] or gate[0][1:] != up[0][1:]:
            raise ValueError(f"{self.model_dir}: {layer}'s gate and up projections differ")
        w13 = (gate[0][0] + up[0][0], *gate[0][1:])
        return [("w13_weight", w13, gate[1]), ("w2_weight", down[0], down[1])]

    def _spec(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        file = self._where.get(key)
        if file is None:
            raise KeyError(f"{self.model_dir}: no tensor {key}")
        part = self._handle(file).get_slice(key)
        dtype = DTYPES.get(part.get_dtype())
        if dtype is None:
            raise ValueError(f"{self.model_dir}: {key} is {part.get_dtype()}, not bf16/fp16/fp32")
        return tuple(part.get_shape()), dtype

    def expert_nbytes(self, layer: str) -> int:
        """Bytes of one expert of ``layer`` (its tensors, read from the headers)."""
        total = 0
        for _, shape, dtype in self.tensor_specs(layer):
            count = 1
            for n in shape:
                count *= n
            total += count * dtype.itemsize
        return total
