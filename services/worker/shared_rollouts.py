"""Placement of LoRA jobs onto this node's shared rollouts (one per base model).

With ``shared_lora_capacity > 0`` a LoRA RL job on CPU devices does not get a rollout process
of its own: it joins the node's shared rollout of its base model (rollout/shared_server.py)
when that one has room, and the worker starts one when there is none yet. A full engine, a full
fine-tuning job, SFT, inference or a GPU lease keeps the private rollout of before. The shared
process ends when its last job leaves. Each job's trainer still talks to it with the job's own
token, and the rollout lets a token reach only its own job's adapter and trajectories.

The scheduler is not involved: it leases devices as before, and sharing happens among the jobs
it placed on this worker (a per-node decision).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from opentinker.common.v1 import common_pb2
from opentinker.services.common.launch import wait_for_file
from opentinker.services.worker.settings import WorkerSettings
from opentinker.services.worker.supervisor import ManagedProcess

log = structlog.get_logger(__name__)


def shares_engine(job: common_pb2.Job, device_ids: list[str]) -> bool:
    """Whether a job may join a shared engine: LoRA RL training on CPU devices (the shared
    engine is transformers + peft; on GPU the vLLM engine's multi-LoRA will serve instead)."""
    spec = job.spec
    return (
        spec.kind == common_pb2.JOB_KIND_RL
        and spec.model.finetune == common_pb2.FINETUNE_MODE_LORA
        and bool(spec.model.base_model)
        and all(d.rsplit("/", 1)[-1].startswith("cpu") for d in device_ids)
    )


@dataclass
class _Engine:
    base_model: str
    process: ManagedProcess
    address: str
    jobs: set[str] = field(default_factory=set)


class SharedRollouts:
    """This node's shared rollout processes, by base model."""

    def __init__(self, settings: WorkerSettings, env: dict[str, str]) -> None:
        self.settings = settings
        self.capacity = settings.shared_lora_capacity
        self._env = env
        self._engines: dict[str, _Engine] = {}
        self._lock = asyncio.Lock()

    def serving(self, base_model: str) -> list[str]:
        """The jobs on the shared engine of ``base_model`` (for people and tests)."""
        engine = self._engines.get(base_model)
        return sorted(engine.jobs) if engine else []

    async def join(self, job_id: str, base_model: str) -> str | None:
        """The address of the shared rollout ``job_id`` now uses, or None when it must have a
        private one (the engine is full, or it could not be started)."""
        async with self._lock:
            engine = self._engines.get(base_model)
            if engine is not None and not engine.process.running:
                log.warning(
                    "shared_rollout_died", base_model=base_model, log=str(engine.process.log_path)
                )
                del self._engines[base_model]
                engine = None
            if engine is None:
                engine = await self._start(base_model)
                if engine is None:
                    return None
                self._engines[base_model] = engine
            if len(engine.jobs) >= self.capacity:
                log.info("shared_rollout_full", base_model=base_model, jobs=len(engine.jobs))
                return None
            engine.jobs.add(job_id)
            log.info(
                "shared_rollout_joined", job_id=job_id, base_model=base_model, jobs=len(engine.jobs)
            )
            return engine.address

    async def leave(self, job_id: str, base_model: str) -> None:
        """The job ended: its place is free; the last job out stops the process."""
        async with self._lock:
            engine = self._engines.get(base_model)
            if engine is None or job_id not in engine.jobs:
                return
            engine.jobs.discard(job_id)
            if engine.jobs:
                return
            del self._engines[base_model]
        await engine.process.terminate(self.settings.stop_grace_s)
        log.info("shared_rollout_stopped", base_model=base_model)

    async def close(self) -> None:
        async with self._lock:
            engines, self._engines = list(self._engines.values()), {}
        for engine in engines:
            await engine.process.terminate(self.settings.stop_grace_s)

    async def _start(self, base_model: str) -> _Engine | None:
        digest = hashlib.sha256(base_model.encode()).hexdigest()[:12]
        folder = (Path(self.settings.run_root) / "shared-rollouts" / digest).resolve()
        addr_file = folder / "rollout.addr"
        addr_file.unlink(missing_ok=True)
        argv = [
            *self.settings.rollout_command,
            "--shared-base", base_model,
            "--capacity", str(self.capacity),
            "--addr-file", str(addr_file),
            "--scheduler-address", self.settings.scheduler_address,
            "--envhub-address", self.settings.envhub_address,
        ]  # fmt: skip
        process = await ManagedProcess.start(
            "shared-rollout", argv, log_path=folder / "rollout.log", env=self._env, cwd=folder
        )
        gone = threading.Event()  # set once the wait below is abandoned or the process exits
        exited = asyncio.create_task(process.wait())
        exited.add_done_callback(lambda _: gone.set())
        try:
            address = await asyncio.to_thread(
                wait_for_file,
                addr_file,
                timeout_s=self.settings.rollout_start_timeout_s,
                alive=lambda: not gone.is_set(),
            )
        except (TimeoutError, RuntimeError) as err:
            log.warning(
                "shared_rollout_failed",
                base_model=base_model,
                error=str(err),
                log=str(folder / "rollout.log"),
            )
            await process.terminate(0)
            return None
        finally:
            gone.set()
            exited.cancel()
        log.info("shared_rollout_started", base_model=base_model, address=address, pid=process.pid)
        return _Engine(base_model, process, address)
