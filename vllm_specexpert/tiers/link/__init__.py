"""The link between the slow tier and the device cache.

One copy engine's worth of transfers: *demand* copies (the running layer needs them now)
go ahead of *prefetches* not yet started, which can still be dropped
(:meth:`Link.cancel`); started copies are never interrupted. :class:`CpuLink`: a copy
thread, optionally held to an emulated bandwidth/latency. :class:`CudaLink`: two copy
streams, prefetches not cancellable once issued; NOT RUN ON A GPU YET. Details:
docs/design.md, "Execution and the link".
"""

from __future__ import annotations

import torch

from vllm_specexpert.config import LinkConfig, SpecExpertConfigError
from vllm_specexpert.tiers.link.base import ExpertCopy, Link, Transfer, sleep_until
from vllm_specexpert.tiers.link.cpu import Clock, CpuLink


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
