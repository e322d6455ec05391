"""The CUDA link: demand and prefetch copy streams over pinned host memory (see
:mod:`vllm_specexpert.tiers.link`). NOT RUN ON A GPU YET."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_specexpert.tiers.link.base import ExpertCopy, Link, StartCallback, Transfer


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

    def copy_seconds(self, nbytes: int, copies: int) -> float:
        # One launch per transfer: the per-copy cost is a launch, not a memcpy call.
        return 5e-6 + nbytes / (CUDA_ASSUMED_GBPS * 1e9)

    def submit(
        self,
        copy: ExpertCopy,
        prefetch: bool = False,
        on_start: StartCallback | None = None,
        after: Sequence = (),
        ahead: bool = False,  # (every copy is queued on a stream: nothing to hand off)
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
        """Issued on the current stream: the source copies (in one launch of the copy
        kernel where it holds the two tensors of a fused MoE; packed experts gathered on
        the host, moved packed and decoded on the stream)."""
        copy.run(device=self.device)
