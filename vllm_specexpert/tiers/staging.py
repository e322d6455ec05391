"""Host <-> device staging on the decode path: one read back, uploads that do not block.

The host decides which experts to copy, so a decode call reads the router's ids to the
host; on CUDA each ``.cpu()`` is a sync, so :class:`HostReader` packs one call's tensors
into one buffer, one copy, one wait. :func:`upload` sends host-computed index arrays
through pinned memory (a pageable copy would wait for the stream to drain).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

NUMPY_DTYPES = {
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}
"""The dtypes a read returns (numpy has no bfloat16: convert weights first)."""


class HostReader:
    """Reads several small device tensors to the host with one copy and one wait."""

    def __init__(self, device: torch.device, packed: bool | None = None) -> None:
        self.device = device
        self.packed = device.type != "cpu" if packed is None else packed
        """Whether reads go through one packed copy (CUDA; forced on CPU by tests)."""
        self._buffer: torch.Tensor | None = None
        self._event = torch.cuda.Event() if device.type == "cuda" else None

    def read(self, tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
        """The tensors as host arrays (numpy dtypes only), valid after later reads."""
        if not self.packed:
            return [t.numpy() for t in tensors]
        flat = [t.contiguous().view(-1).view(torch.uint8) for t in tensors]
        sizes = [f.numel() for f in flat]
        total = sum(sizes)
        buffer = self._staging(total)
        buffer[:total].copy_(torch.cat(flat), non_blocking=self._event is not None)
        if self._event is not None:
            self._event.record()
            self._event.synchronize()
        host = buffer.numpy()
        out: list[np.ndarray] = []
        offset = 0
        for tensor, size in zip(tensors, sizes, strict=True):
            dtype = NUMPY_DTYPES[tensor.dtype]
            # A copy: the staging buffer is overwritten by the next read.
            out.append(host[offset : offset + size].view(dtype).reshape(tensor.shape).copy())
            offset += size
        return out

    def _staging(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            size = max(nbytes, 4096, 2 * (0 if self._buffer is None else self._buffer.numel()))
            self._buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self._event is not None)
        return self._buffer


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device``: no copy on CPU; on CUDA pinned and non-blocking (the host
    allocator keeps the block until the copy has run)."""
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
