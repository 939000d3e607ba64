"""The trainer's memory figures in every step's metrics (services/trainer/model/memory_metrics.py):
resident memory on CPU, the step's peak allocated / reserved on CUDA (the peaks start over
after each report). The figures in the RL and SFT steps: test_trainer_loop.py, test_sft_loop.py.
"""

from __future__ import annotations

import pytest
import torch

from opentinker.services.trainer.model.memory_metrics import GIB, memory_metrics, resident_bytes


def test_on_cpu_the_figure_is_the_process_resident_memory_and_follows_it() -> None:
    before = memory_metrics(torch.device("cpu"))
    assert set(before) == {"memory_resident_gib"}
    assert 0.05 < before["memory_resident_gib"] < 64  # torch alone is ~0.2 GiB
    block = torch.ones(64 * 2**20)  # 256 MiB, every page written
    after = memory_metrics(torch.device("cpu"))["memory_resident_gib"]
    resident = resident_bytes()
    assert after - before["memory_resident_gib"] > 0.2, (before, after)
    assert resident is not None and abs(resident / GIB - after) < 0.05
    del block


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")
def test_on_cuda_each_step_reports_its_own_peak() -> None:
    device = torch.device("cuda:0")
    memory_metrics(device)  # the peaks start over
    block = torch.ones(128 * 2**20, device=device)  # 512 MiB
    del block
    first = memory_metrics(device)
    assert set(first) == {"memory_allocated_peak_gib", "memory_reserved_peak_gib"}
    assert first["memory_allocated_peak_gib"] >= 0.5
    assert first["memory_reserved_peak_gib"] >= first["memory_allocated_peak_gib"]
    second = memory_metrics(device)  # nothing allocated since: the peak started over
    assert second["memory_allocated_peak_gib"] < 0.25, second
