"""What devices this machine offers: one per CUDA GPU, else CPU slots."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from opentinker.services.common.cores import usable_cores
from opentinker.services.common.cpu_share import SHARE_FILE_ENV, ThreadShareFile
from opentinker.services.worker.settings import WorkerSettings

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Device:
    device_id: str  # "<hostname>/cuda:0" or "<hostname>/cpu:0"
    kind: str  # "cuda" or "cpu"
    memory_bytes: int = 0


def detect_devices(settings: WorkerSettings) -> list[Device]:
    """``settings.devices`` when given; else every CUDA GPU torch sees; else CPU slots."""
    host = settings.hostname
    if settings.devices:
        return [Device(f"{host}/{name}", name.split(":", 1)[0]) for name in settings.devices]
    gpus = _cuda_devices(host)
    if gpus:
        return gpus
    return [Device(f"{host}/cpu:{i}", "cpu") for i in range(settings.num_cpu_slots)]


def _cuda_devices(host: str) -> list[Device]:
    try:
        import torch  # noqa: PLC0415 - heavy and optional: imported only for this check
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [
        Device(f"{host}/cuda:{i}", "cuda", torch.cuda.get_device_properties(i).total_memory)
        for i in range(torch.cuda.device_count())
    ]


def cuda_visible_devices(device_ids: list[str] | tuple[str, ...]) -> str:
    """CUDA_VISIBLE_DEVICES for leased ids: "host/cuda:0","host/cuda:3" -> "0,3"; CPU -> ""."""
    indices = []
    for device_id in device_ids:
        name = device_id.rsplit("/", 1)[-1]
        if name.startswith("cuda:"):
            indices.append(name.split(":", 1)[1])
    return ",".join(indices)


def cpu_share_of(devices: list[Device], path: Path, *, reserved: int = 1) -> ThreadShareFile | None:
    """How job processes share this machine's CPU: the cores but ``reserved`` divided among the
    jobs running now, published at ``path`` (cpu_share.py). torch's default (every core in every
    process) oversubscribes the cores as soon as two jobs run, and their OpenMP threads then spin
    against each other (bench/scaling.py); a fixed split by slots starves a job running alone.
    Even one job's threads on every core stall whenever another process runs (its rollout's or
    trainer's event loop, EnvHub, the scheduler): on 2 cores the demo's strictly on-policy step
    took 0.067 s with 2 threads a process against 0.051 s with 1 (bench/vs_inprocess.py). A
    larger model's compute is coarse enough to use every core: its job takes the share without
    the reserve (``LaunchConfig.leaves_cores_to_services``). None when the worker offers GPUs
    or the operator set OMP_NUM_THREADS."""
    if not any(d.kind == "cpu" for d in devices) or "OMP_NUM_THREADS" in os.environ:
        return None
    return ThreadShareFile(path.resolve(), cores=usable_cores(), reserved=reserved)


def cpu_share_path(settings: WorkerSettings) -> Path:
    """One share file per worker (several may run on one machine, e.g. in tests)."""
    safe_id = re.sub(r"[^A-Za-z0-9_.-]", "_", settings.worker_id)
    return settings.run_root / f".cpu-threads-{safe_id}"


def publish_cpu_share(share: ThreadShareFile, running_jobs: int, logger: Any) -> None:
    """Publish the threads per process for ``running_jobs`` (at each launch and exit)."""
    try:
        threads = share.publish(running_jobs)
    except OSError as err:  # the jobs keep the threads they have; nothing else depends on it
        logger.warning("cpu_share_not_written", path=str(share.path), error=str(err))
        return
    logger.info("cpu_share", running_jobs=running_jobs, threads_per_process=threads)


def cpu_thread_env(devices: list[Device], share: ThreadShareFile | None) -> dict[str, str]:
    """The environment of every job process: where the share is, and the threads a process
    starts with until it first reads it (the cores divided among the CPU slots)."""
    cpu_slots = sum(d.kind == "cpu" for d in devices)
    if share is None or not cpu_slots:
        return {}
    return {
        "OMP_NUM_THREADS": str(share.threads_for(cpu_slots)),
        SHARE_FILE_ENV: str(share.path),
    }
