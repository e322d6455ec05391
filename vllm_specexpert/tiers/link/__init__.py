"""The link between the slow tier and the device cache.

One copy engine's worth of transfers, with two kinds of requests: *demand* copies (the
layer that is running needs them now) and *prefetches* (a prediction for the next layer).
Both backends keep prefetches that have not started in a host-side queue, so that a
demand copy goes ahead of them and an unneeded one can still be dropped
(:meth:`Link.cancel`); started copies are never interrupted, like a real DMA engine.

* :class:`CpuLink` (CPU build, tests, benchmarks): one copy worker thread performs every
  copy for real (a prefetch's bytes may land before its emulated start; a cancelled one
  never lands after :meth:`Link.cancel` returned). With an emulated bandwidth/latency the
  link is modeled as a single engine: a transfer starts when the link is free (demand
  ones first), takes ``latency * copies + bytes / bandwidth``, and its data counts as
  usable only from then. The consumer waits for that moment in :meth:`Transfer.wait`, so
  the emulation holds the compute exactly where a GPU would stall, without burning the
  copy thread.
* :class:`CudaLink`: two copy streams over pinned host memory (demand copies on a
  high-priority one, prefetches on a low-priority one), issued the moment they are
  submitted, one launch per transfer (:func:`~vllm_specexpert.triton_kernels.slots.
  copy_experts`), one event each; waiting is a stream-side ``wait_event`` (no host
  sync). A copy is ordered only after what it must follow: the kernels that last read
  its destination slots and the earlier copies into them (``after``), never after the
  whole compute stream. Issued prefetches cannot be cancelled. NOT RUN ON A GPU YET:
  written against PyTorch's stream/event API, exercised here only by review.
"""

from __future__ import annotations

import torch

from vllm_specexpert.config import LinkConfig, SpecExpertConfigError
from vllm_specexpert.tiers.link.base import (
    Clock,
    ExpertCopy,
    Link,
    Transfer,
    sleep_until,
)
from vllm_specexpert.tiers.link.cpu import CpuLink


def make_link(config: LinkConfig, device: torch.device) -> Link:
    """The link for ``device``: CUDA copy stream on a GPU, copy thread on CPU."""
    if device.type == "cuda":
        if config.emulated:
            raise SpecExpertConfigError(
                "link.bandwidth_gbps",
                "link emulation is for CPU runs; on CUDA the real copy engine is used",
                "remove 'link' from the config on GPU machines",
            )
        from vllm_specexpert.tiers.link.cuda import CudaLink

        return CudaLink(device)
    return CpuLink(config)


__all__ = ["Clock", "CpuLink", "ExpertCopy", "Link", "Transfer", "make_link", "sleep_until"]
