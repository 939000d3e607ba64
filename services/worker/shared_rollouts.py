"""Placement of LoRA jobs onto this node's shared rollouts (one per base model).

With ``shared_lora_capacity > 0`` a LoRA RL job does not get a rollout process of its own: it
joins the node's shared rollout of its base model (rollout/shared/shared_server.py) when that one
has room, and the worker starts one when there is none yet. A full engine, a full fine-tuning job,
SFT, inference, or a lease mixing CPU and GPU devices keeps the private rollout of before. The
shared process ends when its last job leaves.

On a GPU node the shared rollout is started on the GPUs of the job that starts it
(``CUDA_VISIBLE_DEVICES``), and picks its engine as a private rollout does (vLLM's multi-LoRA
when vllm is installed); the jobs that join it may hold other GPUs of the node (their trainers
reach it over gRPC). Its LoRA slots are sized for ``shared_lora_max_rank``: a job of a larger
rank gets a private rollout, and so does a job whose lease is of another kind (CPU or GPU)
than the engine's. The shared rollout outlives the job that started it while others use it,
and the ledger frees that job's GPUs when it ends: a job placed there that will not join it
waits until its process has exited, and it takes no new jobs meanwhile (``make_way``,
device_handover.py).
Each job's trainer still talks to it with the job's own
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
from opentinker.services.worker.devices import cuda_visible_devices
from opentinker.services.worker.settings import WorkerSettings
from opentinker.services.worker.supervisor import ManagedProcess

log = structlog.get_logger(__name__)


def lease_kind(device_ids: list[str]) -> str | None:
    """ "cpu" or "cuda" when every leased device is of that kind, else None (mixed, or none)."""
    kinds = {d.rsplit("/", 1)[-1].split(":", 1)[0] for d in device_ids}
    return kinds.pop() if len(kinds) == 1 and kinds <= {"cpu", "cuda"} else None


def shares_engine(job: common_pb2.Job, device_ids: list[str]) -> bool:
    """Whether a job may join a shared engine: LoRA RL training on CPU devices (peft's mixed
    batches) or on CUDA devices (vLLM's multi-LoRA; peft's without vllm), not both. A shared
    engine renders with its base tokenizer's own chat template, so a job that chose another
    (``ModelSpec.chat_template``) gets a rollout of its own."""
    spec = job.spec
    return (
        spec.kind == common_pb2.JOB_KIND_RL
        and spec.model.finetune == common_pb2.FINETUNE_MODE_LORA
        and bool(spec.model.base_model)
        and not spec.model.chat_template
        and lease_kind(device_ids) is not None
    )


@dataclass(eq=False)  # each one itself (a set of them)
class _Engine:
    base_model: str
    process: ManagedProcess
    address: str
    kind: str  # "cpu" or "cuda": the devices it runs on
    device_ids: list[str]  # those of the job that started it
    jobs: set[str] = field(default_factory=set)
    closed: bool = False  # to new jobs: a job waits for its GPUs (make_way)
    gone: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )  # done once its process has exited (set by `watch`)
    watch: asyncio.Task[int] | None = None

    def ended(self) -> None:
        if not self.gone.done():
            self.gone.set_result(None)


class SharedRollouts:
    """This node's shared rollout processes, by base model."""

    def __init__(self, settings: WorkerSettings, env: dict[str, str]) -> None:
        self.settings = settings
        self.capacity = settings.shared_lora_capacity
        self._env = env
        self._engines: dict[str, _Engine] = {}  # the current one of each base model
        self._live: set[_Engine] = set()  # every one whose process has not exited (stopping too)
        self._lock = asyncio.Lock()

    def serving(self, base_model: str) -> list[str]:
        """The jobs on the shared engine of ``base_model`` (for people and tests)."""
        engine = self._engines.get(base_model)
        return sorted(engine.jobs) if engine else []

    def make_way(
        self, job: common_pb2.Job, device_ids: list[str]
    ) -> dict[str, asyncio.Future[None]]:
        """The shared GPU rollouts on any of ``device_ids`` that ``job`` will not join (not a
        LoRA job of their base model, or one they would refuse: closed, full, its rank too
        large; or one stopping), each with a future done once its process has exited: it holds
        its GPUs' memory until then (device_handover.py). Each is closed to new jobs (they
        get private rollouts), so that it ends with the jobs it has and the wait is bounded; a
        new shared rollout starts after it. CPU ones hold no memory a job would miss."""
        wanted = set(device_ids)
        in_the_way = [
            engine
            for engine in self._live
            if engine.kind == "cuda"
            and wanted & set(engine.device_ids)
            and not self._takes(engine, job, device_ids)
        ]
        for engine in in_the_way:
            if not engine.closed:
                engine.closed = True
                log.info("shared_rollout_closed_to_new_jobs", base_model=engine.base_model,
                         jobs=sorted(engine.jobs), for_job=job.job_id)  # fmt: skip
        return {f"shared rollout of {engine.base_model}": engine.gone for engine in in_the_way}

    def _takes(self, engine: _Engine, job: common_pb2.Job, device_ids: list[str]) -> bool:
        """Would ``join`` give ``job`` this engine now?"""
        model = job.spec.model
        return (
            self._engines.get(engine.base_model) is engine
            and engine.process.running
            and not engine.closed
            and len(engine.jobs) < self.capacity
            and shares_engine(job, device_ids)
            and model.base_model == engine.base_model
            and model.lora.rank <= self.settings.shared_lora_max_rank
        )

    async def join(
        self, job_id: str, base_model: str, *, device_ids: list[str], rank: int = 0
    ) -> str | None:
        """The address of the shared rollout ``job_id`` (leasing ``device_ids``, LoRA of
        ``rank``) now uses, or None when it must have a private one (the engine is full, runs
        on devices of another kind, its slots are too small for the rank, or it could not be
        started)."""
        kind = lease_kind(device_ids)
        if kind is None:
            return None
        if kind == "cuda" and rank > self.settings.shared_lora_max_rank:
            log.info("shared_rollout_rank_too_large", job_id=job_id, rank=rank)
            return None
        async with self._lock:
            engine = self._engines.get(base_model)
            if engine is not None and not engine.process.running:
                log.warning(
                    "shared_rollout_died", base_model=base_model, log=str(engine.process.log_path)
                )
                del self._engines[base_model]
                await engine.process.terminate(0)  # what it left (its process group)
                engine = None
            if engine is None:
                engine = await self._start(base_model, kind, device_ids)
                if engine is None:
                    return None
                self._engines[base_model] = engine
            if engine.kind != kind:
                log.info("shared_rollout_other_devices", base_model=base_model, kind=engine.kind)
                return None
            if engine.closed:
                log.info("shared_rollout_closed", base_model=base_model, jobs=len(engine.jobs))
                return None
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
        await engine.process.terminate(self.settings.stop_grace_s)  # still in _live meanwhile
        log.info("shared_rollout_stopped", base_model=base_model)

    async def close(self) -> None:
        async with self._lock:
            engines, self._engines = list(self._engines.values()), {}
        for engine in engines:
            await engine.process.terminate(self.settings.stop_grace_s)

    async def _start(self, base_model: str, kind: str, device_ids: list[str]) -> _Engine | None:
        digest = hashlib.sha256(base_model.encode()).hexdigest()[:12]
        folder = (Path(self.settings.run_root) / "shared-rollouts" / digest).resolve()
        addr_file = folder / "rollout.addr"
        addr_file.unlink(missing_ok=True)
        argv = [
            *self.settings.rollout_command,
            "--shared-base", base_model,
            "--capacity", str(self.capacity),
            "--max-lora-rank", str(self.settings.shared_lora_max_rank),
            "--addr-file", str(addr_file),
            "--scheduler-address", self.settings.scheduler_address,
            "--envhub-address", self.settings.envhub_address,
        ]  # fmt: skip
        # The GPUs of the job that starts it (none on CPU: as a CPU job's processes see).
        env = {**self._env, "CUDA_VISIBLE_DEVICES": cuda_visible_devices(device_ids)}
        process = await ManagedProcess.start(
            "shared-rollout", argv, log_path=folder / "rollout.log", env=env, cwd=folder
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
        engine = _Engine(base_model, process, address, kind, list(device_ids))
        self._live.add(engine)
        engine.gone.add_done_callback(lambda _: self._live.discard(engine))
        engine.watch = asyncio.create_task(process.wait())
        engine.watch.add_done_callback(lambda _: engine.ended())
        return engine
