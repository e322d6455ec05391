"""What memory the tier a budget sizes has free now: the GPU's on CUDA, RAM on the CPU
build (``MemAvailable``: free pages and the page cache the kernel can reclaim)."""

from __future__ import annotations

import psutil
import torch

from vllm_specexpert.config.sizing import MemoryReport, SizingSettings


def memory_report(
    device: torch.device, settings: SizingSettings, freed_bytes: int = 0
) -> MemoryReport:
    """The memory of ``device``'s tier now, with vLLM's share and KV settings."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    else:
        ram = psutil.virtual_memory()
        free, total = ram.available, ram.total
    return MemoryReport(
        total_bytes=int(total),
        free_bytes=int(free),
        utilization=settings.utilization,
        kv_cache_bytes=settings.kv_cache_bytes,
        freed_bytes=freed_bytes,
    )
