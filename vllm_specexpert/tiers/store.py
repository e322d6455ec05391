"""The slow tier: every routed expert of every MoE layer, outside the device cache.

Pinned host memory on CUDA (copies are async DMA), plain RAM on CPU. A layer's experts
are named tensors whose leading dimension is the expert id (``w13_weight [E, 2I, H]``,
``w2_weight [E, H, I]``, in the kernel's runtime layout); one expert is the slice ``[e]``
of each. Quantized experts stay packed here and in transit: the layer's
:class:`ExpertDecoder` turns them into slot contents on arrival.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from vllm_specexpert.config import SpecExpertConfigError

SlotShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""Slot tensor name -> (shape of one slot, dtype)."""


LOW_BIT_SUFFIX = ".int4"
"""Store name of a layer's INT4 copies beside its experts: the adapter adds them as
``name + LOW_BIT_SUFFIX`` before the layer (``lowbit``'s place reads them)."""


class ExpertsUnreadable(RuntimeError):
    """Experts the slow tier could not supply mid-generation (read error, bad checksum):
    the engine runs the call without them; only the requests that needed them fail.
    ``causes``: each expert's own cause; ``field`` and ``fix``: the config field that
    names where they are read from, and what repairs it (:meth:`refusal`)."""

    def __init__(self, layer: str, causes: dict[int, str], field: str = "", fix: str = "") -> None:
        self.layer = layer
        self.causes = causes
        self.experts = sorted(causes)
        self.cause = causes[self.experts[0]]
        """The first expert's cause (each expert's: :attr:`causes`)."""
        super().__init__(f"{layer}: experts {self.experts} could not be read: {self.cause}")
        self.field = field
        self.fix = fix

    def refusal(self, outcome: str) -> SpecExpertConfigError:
        """This error as one config error naming :attr:`field` (a change that needed
        these experts refused), ``outcome`` saying what became of the engine."""
        return SpecExpertConfigError(
            self.field,
            f"{self.layer}'s experts {self.experts} could not be read ({self.cause}); {outcome}",
            self.fix,
        )


class ExpertDecoder(Protocol):
    """Turns packed experts (slices ``[n, ...]`` of a layer's store tensors) into the
    slot tensors the kernel runs on (``[n, ...]`` each, :attr:`slot_shapes`)."""

    name: str
    """The packed format (e.g. ``awq``)."""
    slot_shapes: SlotShapes

    def __call__(self, packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


class ExpertSource(Protocol):
    """One layer's routed experts in the slow tier, wherever they live (host RAM:
    :class:`LayerExperts`; disk: :class:`~vllm_specexpert.tiers.disk.DiskExperts`):
    what the cache, the loader and the link need of them."""

    name: str
    num_experts: int
    expert_nbytes: int
    """Bytes of one expert as the slow tier holds it: what the link moves."""
    num_tensors: int
    decoder: ExpertDecoder | None

    @property
    def format(self) -> str: ...

    @property
    def packed_format(self) -> str | None:
        """The quantized format the experts are held in (``None``: bf16/fp16)."""
        ...

    @property
    def slot_shapes(self) -> SlotShapes: ...

    @property
    def slot_nbytes(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def memory_nbytes(self) -> int:
        """Of :attr:`nbytes`, what this tier holds in memory (the rest is on disk)."""
        ...

    @property
    def staging_nbytes(self) -> int:
        """Memory its reads take beside the slots while they run (buffers read into,
        experts being decoded): 0 for experts in RAM."""
        ...

    def gather(self, experts: np.ndarray) -> dict[str, torch.Tensor]:
        """``experts``' tensors as the slow tier holds them (packed), ``[n, ...]`` each."""
        ...

    def decoded(self, experts: np.ndarray | slice) -> dict[str, torch.Tensor]:
        """Slot contents of ``experts``, ``[n, ...]`` per slot tensor."""
        ...

    def copy_into(
        self,
        experts: np.ndarray,
        slots: np.ndarray,
        destinations: dict[str, torch.Tensor],
        device: torch.device | None = None,
    ) -> None:
        """Write the slot contents of ``experts`` into ``slots`` of the ``destinations``
        pools: on the host (the CPU build's slots), or issued on the current stream of
        ``device`` (CUDA)."""
        ...

    def copy_seconds(self) -> float:
        """Expected seconds of one expert's copy into a slot, learned from this tier's
        real copies (a memcpy from RAM, a read from disk)."""
        ...

    @property
    def in_place(self) -> bool:
        """The kernel reads the experts where this tier holds them (a mapped pack): the
        layer's pool is all of them, :meth:`kernel_pool`."""
        ...

    def kernel_pool(self, device: torch.device) -> Any:
        """The slot pool of this layer's cache when :attr:`in_place` (a mapped pack:
        :class:`~.mapped.MappedPool`); ``None``: slots the experts are copied into."""
        ...

    def copied(self, nbytes: int, seconds: float) -> None:
        """A real copy of ``nbytes`` from this tier took ``seconds``."""
        ...


class SlotForm:
    """What a slow tier's layer of experts derives the same way wherever it holds them:
    from its decoder, else from the shapes it holds (:meth:`held_shapes`); and the time
    of its copies, learned from the real ones (:meth:`copied`)."""

    num_experts: int
    expert_nbytes: int
    decoder: ExpertDecoder | None
    seconds_per_byte: float = 1e-10
    """Measured cost of this tier's copies (a running mean; a first guess of 10 GB/s)."""

    def copied(self, nbytes: int, seconds: float) -> None:
        if nbytes:
            self.seconds_per_byte = 0.9 * self.seconds_per_byte + 0.1 * seconds / nbytes

    def copy_seconds(self) -> float:
        return self.expert_nbytes * self.seconds_per_byte

    in_place = False

    def kernel_pool(self, device: torch.device) -> Any:
        return None

    def held_shapes(self) -> SlotShapes:
        """One expert's tensors as this tier holds them."""
        raise NotImplementedError

    @property
    def format(self) -> str:
        if self.decoder is not None:
            return self.decoder.name
        dtype = next(iter(self.held_shapes().values()))[1]
        return str(dtype).removeprefix("torch.")

    @property
    def slot_shapes(self) -> SlotShapes:
        if self.decoder is not None:
            return self.decoder.slot_shapes
        return self.held_shapes()

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot (what one expert takes on the device)."""
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.slot_shapes.values())

    @property
    def nbytes(self) -> int:
        return self.expert_nbytes * self.num_experts

    @property
    def memory_nbytes(self) -> int:
        """Of :attr:`nbytes`, what this tier holds in memory (all, for experts in RAM)."""
        return self.nbytes


def stage(
    source: ExpertSource,
    experts: np.ndarray,
    slots: np.ndarray,
    destinations: dict[str, torch.Tensor],
    device: torch.device | None,
) -> None:
    """Copy ``experts`` by gathering them as the slow tier holds them, moving them so
    onto ``device`` (if any) and decoding them into their slots there."""
    packed = source.gather(experts)
    if device is not None:
        packed = {key: t.to(device, non_blocking=True) for key, t in packed.items()}
    target = next(iter(destinations.values())).device
    index = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(target)
    decoded = packed if source.decoder is None else source.decoder(packed)
    for key, tensor in decoded.items():
        destinations[key].index_copy_(0, index, tensor)


class SlowTier(Protocol):
    """An open slow tier: where its layers' experts are read from (its class is
    registered in :mod:`.slow_tiers`)."""

    name: ClassVar[str]
    """Its section in the engine's stats (its config section, if it has one)."""

    def layer(self, name: str) -> ExpertSource:
        """Layer ``name``'s experts (a config error if the tier has none of it)."""
        ...

    def where(self) -> str:
        """Where the experts are, for the start line."""
        ...

    def stats_dict(self) -> dict: ...

    def reset_stats(self) -> None: ...

    def close(self) -> None: ...


@dataclass
class LayerExperts(SlotForm):
    """All routed experts of one MoE layer in the slow tier."""

    name: str
    """vLLM layer name, e.g. ``model.layers.3.mlp.experts``."""
    tensors: dict[str, torch.Tensor]
    """Tensor name -> ``[num_experts, ...]`` host tensor."""
    decoder: ExpertDecoder | None = None
    """Packed experts: what turns them into slot contents (``None``: slots hold the
    tensors as they are)."""

    def __post_init__(self) -> None:
        # Read on every layer call (link time estimates): computed once, the tensors
        # of a layer never change shape.
        self.num_experts: int = next(iter(self.tensors.values())).shape[0]
        self.expert_nbytes: int = sum(
            t[0].numel() * t.element_size() for t in self.tensors.values()
        )
        self.num_tensors: int = len(self.tensors)

    @property
    def packed_format(self) -> str | None:
        return self.decoder.name if self.decoder is not None else None

    def held_shapes(self) -> SlotShapes:
        return {key: (tuple(t.shape[1:]), t.dtype) for key, t in self.tensors.items()}

    def gather(self, experts: np.ndarray) -> dict[str, torch.Tensor]:
        index = torch.from_numpy(np.asarray(experts, dtype=np.int64))
        return {key: t.index_select(0, index) for key, t in self.tensors.items()}

    def decoded(self, experts: torch.Tensor | np.ndarray | slice) -> dict[str, torch.Tensor]:
        """Slot contents of ``experts`` (ids or a slice), ``[n, ...]`` per slot tensor:
        views of the store when it holds them as they are, else decoded copies."""
        packed = {key: t[experts] for key, t in self.tensors.items()}
        return packed if self.decoder is None else self.decoder(packed)

    def copy_into(
        self,
        experts: np.ndarray,
        slots: np.ndarray,
        destinations: dict[str, torch.Tensor],
        device: torch.device | None = None,
    ) -> None:
        """As the slots hold them: slice by slice (on CUDA, pairs of fused tensors in one
        launch of the copy kernel from the tensors' device views); packed: gathered,
        moved as they are and decoded into the slots."""
        if self.decoder is not None:
            stage(self, experts, slots, destinations, device)
        elif device is not None and device.type == "cuda" and len(self.tensors) == 2:
            from vllm_specexpert.triton_kernels.slots import copy_experts

            index = torch.from_numpy(np.stack([experts, slots]).astype(np.int32)).to(device)
            (a, src_a), (b, src_b) = self.tensors.items()
            sources = (self._device_view(src_a), self._device_view(src_b))
            copy_experts(sources, (destinations[a], destinations[b]), index[0], index[1])
        else:
            for expert, slot in zip(experts.tolist(), slots.tolist(), strict=True):
                for key, tensor in self.tensors.items():
                    destinations[key][slot].copy_(tensor[expert], non_blocking=device is not None)

    def _device_view(self, host: torch.Tensor) -> torch.Tensor:
        """``host``'s UVA view on the device (the copy kernel reads it), made once."""
        views = self.__dict__.setdefault("_device_views", {})
        view = views.get(host.data_ptr())
        if view is None:
            from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

            view = views[host.data_ptr()] = get_accelerator_view_from_cpu_tensor(host)
        return view

    @property
    def staging_nbytes(self) -> int:
        return 0


class ExpertStore:
    """Routed experts of every MoE layer of one worker, in the slow tier."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.layers: dict[str, ExpertSource] = {}
        self.tiers: list[SlowTier] = []
        """The open slow tiers the layers' experts are read from (none: the host's
        tensors), opened by the adapter (:mod:`.slow_tiers`)."""

    def add_layer(
        self, name: str, tensors: dict[str, torch.Tensor], decoder: ExpertDecoder | None = None
    ) -> LayerExperts:
        """Take ownership of a layer's expert tensors (moved to host, pinned on CUDA);
        ``decoder`` for packed ones."""
        if name in self.layers:
            raise ValueError(f"layer {name} is already in the expert store")
        num_experts = {t.shape[0] for t in tensors.values()}
        if len(num_experts) != 1:
            raise ValueError(f"layer {name}: expert tensors disagree on the expert count")
        host = {}
        for key, tensor in tensors.items():
            tensor = tensor.detach()
            if tensor.device.type != "cpu":
                raise ValueError(
                    f"layer {name}: expert tensor {key} is on {tensor.device}; the store "
                    "takes host tensors (experts must never be materialized on the device)"
                )
            tensor = tensor.contiguous()
            if self.pin_memory and not tensor.is_pinned():
                tensor = pin_in_place(tensor)
            host[key] = tensor
        layer = LayerExperts(name=name, tensors=host, decoder=decoder)
        self.layers[name] = layer
        return layer

    def add(self, layer: ExpertSource) -> ExpertSource:
        """A layer whose experts live elsewhere (on disk)."""
        if layer.name in self.layers:
            raise ValueError(f"layer {layer.name} is already in the expert store")
        self.layers[layer.name] = layer
        return layer

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers.values())

    def tier(self, name: str) -> SlowTier | None:
        """The open slow tier ``name``, if it is open."""
        return next((tier for tier in self.tiers if tier.name == name), None)

    def where(self) -> str:
        if self.tiers:
            return "; ".join(tier.where() for tier in self.tiers)
        return f"on the host{' (pinned)' if self.pin_memory else ''}"

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


CUDA_HOST_REGISTER_PORTABLE = 0x01
CUDA_HOST_REGISTER_MAPPED = 0x02
"""``cudaHostRegister`` flags (CUDA runtime API)."""


def pin_in_place(tensor: torch.Tensor) -> torch.Tensor:
    """Page-lock ``tensor``'s memory where it is (``cudaHostRegister``): unlike
    ``Tensor.pin_memory()`` no second copy, which would double peak host memory while
    the model loads (the fallback if the driver refuses). Not yet run on a GPU."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return tensor
    # Portable: usable from every device's context; mapped: a device pointer exists
    # for it (the UVA view that copy_experts reads).
    error = torch.cuda.cudart().cudaHostRegister(
        tensor.data_ptr(), nbytes, CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED
    )
    if int(error) != 0:
        return tensor.pin_memory()
    return tensor
