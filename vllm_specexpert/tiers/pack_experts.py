"""One layer's experts in an expert pack (:mod:`.expert_pack`), as a slow tier: what the
disk tier's two residencies share (:class:`~.disk.DiskExperts`: read into slots;
:class:`~.mapped.MappedExperts`: run on the mapped pages)."""

from __future__ import annotations

import numpy as np
import torch

from vllm_specexpert.tiers.disk_reader import aligned_empty
from vllm_specexpert.tiers.expert_pack import ExpertPack, PackLayer
from vllm_specexpert.tiers.kernel_form import DTYPES
from vllm_specexpert.tiers.store import ExpertDecoder, SlotForm, SlotShapes


class PackExperts(SlotForm):
    """A pack layer's experts: the target's in the kernel's form (nothing to decode,
    slots shaped as the pack holds them), or the draft's packed, with their ``decoder``
    into slots. Subclasses read them (:meth:`gather`) and fill slots (``copy_into``)
    their residency's way."""

    def __init__(
        self, pack: ExpertPack, layer: PackLayer, decoder: ExpertDecoder | None = None
    ) -> None:
        self.pack = pack
        self.record = layer
        self.name = layer.name
        self.decoder = decoder
        self.num_experts = layer.num_experts
        self.expert_nbytes = layer.expert_nbytes
        self.num_tensors = len(layer.tensors)

    @property
    def packed_format(self) -> str | None:
        # (the target's are bf16/fp16: a quantized checkpoint is refused)
        return None if self.decoder is None else self.decoder.name

    @property
    def memory_nbytes(self) -> int:
        return 0  # (on disk; a residency that keeps some in memory says so)

    def held_shapes(self) -> SlotShapes:
        return {t.name: (tuple(t.shape), DTYPES[t.dtype]) for t in self.record.tensors}

    def gather(self, experts: np.ndarray) -> dict[str, torch.Tensor]:
        """``experts`` copied into new page-aligned host tensors (``O_DIRECT`` lands in
        them), as this residency copies into slots."""
        n = len(experts)
        out = {
            key: aligned_empty((n, *shape), dtype)
            for key, (shape, dtype) in self.held_shapes().items()
        }
        self.read_rows(np.asarray(experts), out, list(range(n)))
        return out

    def copy_into(
        self,
        experts: np.ndarray,
        slots: np.ndarray,
        destinations: dict[str, torch.Tensor],
        device: torch.device | None = None,
    ) -> None:
        raise NotImplementedError

    def read_rows(
        self, experts: np.ndarray, destinations: dict[str, torch.Tensor], rows: list[int]
    ) -> None:
        """Read ``experts[i]`` into row ``rows[i]`` of ``destinations`` (host tensors,
        ``[n, ...]`` per tensor name), blocking; one
        :class:`~vllm_specexpert.tiers.store.ExpertsUnreadable` names those that failed."""
        raise NotImplementedError

    def decoded(self, experts: np.ndarray | slice) -> dict[str, torch.Tensor]:
        if isinstance(experts, slice):
            experts = np.arange(self.num_experts)[experts]
        packed = self.gather(np.asarray(experts))
        return packed if self.decoder is None else self.decoder(packed)
