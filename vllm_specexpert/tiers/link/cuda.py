"""The CUDA link: demand and prefetch copy streams over pinned host memory (see
:mod:`vllm_specexpert.tiers.link`). NOT RUN ON A GPU YET."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm_specexpert.tiers.link.base import ExpertCopy, Link, StartCallback, Transfer
from vllm_specexpert.tiers.staging import upload


class _CudaTransfer(Transfer):
    def __init__(self, copy: ExpertCopy, prefetch: bool, on_start: StartCallback | None) -> None:
        self.nbytes = copy.nbytes
        self.prefetch = prefetch
        self.on_start = on_start
        self.event = torch.cuda.Event()
        """Recorded on the copy stream right after the copy."""

    def ready(self) -> bool:
        return self.event.query()

    def wait(self) -> float:
        # Stream-side dependency: kernels queued after this point on the compute
        # stream start once the copy is done. No host synchronization.
        torch.cuda.current_stream().wait_event(self.event)
        return 0.0


CUDA_ASSUMED_GBPS = 20.0
"""Host-to-device bandwidth the CUDA link assumes when estimating a copy's duration
(PCIe 4.0 x16 with pinned memory moves about 20-25 GB/s). Not measured: an estimate."""


class CudaLink(Link):
    """Demand and prefetch copy streams over pinned host memory (see module doc). Not
    yet run on a GPU."""

    cancellable = False

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        # Lower number = higher priority: the copy a kernel is waiting for goes first
        # where both streams have work (copy_experts runs on SMs, so this matters).
        # (a static method; torch's stub declares it without @staticmethod)
        low, high = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
        self.demand_stream = torch.cuda.Stream(device=device, priority=high)
        self.prefetch_stream = torch.cuda.Stream(device=device, priority=low)
        self._last: dict[bool, _CudaTransfer] = {}
        """Prefetch flag -> the last transfer issued on that stream."""
        self._device_views: dict[int, torch.Tensor] = {}
        """Slow-tier tensor data pointer -> its UVA device view (copy_experts reads it)."""

    def copy_seconds(self, nbytes: int, copies: int) -> float:
        # One launch per transfer: the per-copy cost is a launch, not a memcpy call.
        return 5e-6 + nbytes / (CUDA_ASSUMED_GBPS * 1e9)

    def submit(
        self,
        copy: ExpertCopy,
        prefetch: bool = False,
        on_start: StartCallback | None = None,
        after: Sequence = (),
    ) -> Transfer:
        transfer = _CudaTransfer(copy, prefetch, on_start)
        stream = self.prefetch_stream if prefetch else self.demand_stream
        for dependency in after:
            event = dependency.event if isinstance(dependency, _CudaTransfer) else dependency
            stream.wait_event(event)
        with torch.cuda.stream(stream):
            self._copy(copy)
            transfer.event.record(stream)
        self._last[prefetch] = transfer
        self._started(transfer, 1)
        return transfer

    def idle(self) -> bool:
        return all(t.event.query() for t in self._last.values())

    def close(self) -> None:
        """Nothing may still be copying into a slot pool that is about to be freed
        (``reconfigure`` closes the link, then drops the pools)."""
        self.demand_stream.synchronize()
        self.prefetch_stream.synchronize()

    def _copy(self, copy: ExpertCopy) -> None:
        """One launch for every expert and tensor of ``copy`` where the layer has the
        two tensors of a fused MoE (w13, w2); packed experts are gathered on the host,
        moved packed and decoded on the copy stream; else one async memcpy per pair."""
        sources = copy.sources
        if copy.decoder is not None or sources is None or len(sources) != 2:
            copy.run(staging=self.device)
            return
        from vllm_specexpert.triton_kernels.slots import copy_experts

        index = upload(np.stack([copy.experts, copy.slots]).astype(np.int32), self.device)
        src0, src1 = (self._device_view(t) for t in sources.values())
        dst0, dst1 = (copy.destinations[k] for k in sources)
        copy_experts((src0, src1), (dst0, dst1), index[0], index[1])

    def _device_view(self, host: torch.Tensor) -> torch.Tensor:
        view = self._device_views.get(host.data_ptr())
        if view is None:
            from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

            view = self._device_views[host.data_ptr()] = get_accelerator_view_from_cpu_tensor(host)
        return view
