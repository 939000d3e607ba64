"""How much memory the trainer holds: what a user sizes models, batches and micro-batches by.

On CUDA, the peak memory allocated and reserved (torch's caching allocator) on the trainer's
device since the last step's report, which then resets the peaks, as verl and TRL report
them. On CPU, the trainer process's resident memory when the step ends (Linux's
``/proc/self/statm``; nothing where it cannot be read). With several ranks, rank 0's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

GIB = float(2**30)


def memory_metrics(device: torch.device) -> dict[str, float]:
    """The step's memory figures (in GiB) for ``device``; on CUDA the peaks start over."""
    if device.type == "cuda":
        figures = {
            "memory_allocated_peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "memory_reserved_peak_gib": torch.cuda.max_memory_reserved(device) / GIB,
        }
        torch.cuda.reset_peak_memory_stats(device)
        return figures
    resident = resident_bytes()
    return {} if resident is None else {"memory_resident_gib": resident / GIB}


def resident_bytes() -> int | None:
    """This process's resident set size, or None where /proc cannot say."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
