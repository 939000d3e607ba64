"""One attempt of one job on this worker: start rollout and trainer, and report how it ended.
An SFT job has no rollout: the trainer alone.

A private rollout and its trainer start at the same time: each spends seconds importing torch
and transformers, and the trainer loads its policy, before either needs the other. The trainer
reads the rollout's address from ``rollout.addr`` when it opens the rollout
(trainer/rollout_link/rollout_address.py); the worker alone judges the rollout's start (it dies, is
late, or the run is stopped: the attempt fails with that reason and both processes are ended).

A hung or killed process is a lost attempt, re-queued, not a failed job; attempt_faults.py
judges which process failed and on whose fault, and words the reason.

``run_root/<job_id>/attempt-<n>/`` holds launch.json, rollout.log, rollout.addr and trainer.log.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.common.exit_codes import PEER_LOST
from opentinker.services.common.launch import LaunchConfig, wait_for_file, write_atomic
from opentinker.services.modeling.spare import Handover
from opentinker.services.worker.attempt_faults import (
    Exit,
    Proc,
    died,
    rollout_lost,
    trainer_lost,
)
from opentinker.services.worker.devices import cuda_visible_devices
from opentinker.services.worker.gguf_models import with_imported_model
from opentinker.services.worker.job_user import JobUser
from opentinker.services.worker.ranks import (
    RANK_ENV_KEYS,
    RENDEZVOUS_KEYS,
    RankGroup,
    rank_envs,
)
from opentinker.services.worker.reusable import JobProcess, hand_to_spare, reusable_job
from opentinker.services.worker.settings import WorkerSettings
from opentinker.services.worker.shared_rollouts import SharedRollouts, shares_engine
from opentinker.services.worker.spares import SparePool
from opentinker.services.worker.spec_paths import refused_path
from opentinker.services.worker.supervisor import ManagedProcess, last_meaningful_line
from opentinker.services.worker.trainer_hosts import HostedTrainer, HostStartError, TrainerHosts

log = structlog.get_logger(__name__)

# How much longer than the worker's own wait for rollout.addr its trainer waits (the worker
# polls, then ends both processes: the trainer must not fail the job first).
TRAINER_WAIT_GRACE_S = 60.0


class JobRun:
    """Runs one LaunchJob. ``run()`` returns the Exit; ``stop(reason)`` ends it early."""

    def __init__(
        self,
        job: common_pb2.Job,
        *,
        lease_id: str,
        device_ids: list[str],
        job_token: str,
        settings: WorkerSettings,
        on_launched: Callable[[], Awaitable[None]],
        spares: SparePool | None = None,
        extra_env: dict[str, str] | None = None,
        shared: SharedRollouts | None = None,
        user: JobUser | None = None,
        hosted: tuple[TrainerHosts, scheduler_pb2.LaunchJob] | None = None,
    ) -> None:
        """shared: the node's shared rollouts, which a LoRA job joins when one has room.
        user: the uid this job's processes run as (job_user.py); None: the agent's."""
        self.job = job
        self.lease_id = lease_id
        self.device_ids = device_ids
        self.job_token = job_token
        self.settings = settings
        self.run_dir = Path(settings.run_root) / job.job_id / f"attempt-{job.attempt}"
        self._on_launched = on_launched
        self._stop_reason: str | None = None
        self._stopped = asyncio.Event()
        self._processes: list[Proc] = []
        self._spares = spares
        self._shared = shared
        self._user = user
        # A LoRA session the scheduler placed on a shared LoRA host (trainer_hosts.py): the
        # node's hosts and the launch naming it; None: a trainer of its own.
        self._hosted = hosted if hosted is not None and hosted[1].shared_host_id else None
        if user is not None:  # spares, shared rollouts and hosts run as the agent: not for it
            self._spares, self._shared, self._hosted = None, None, None
            self.settings = settings.model_copy(
                update={
                    "trainer_command": user.command(settings.trainer_command),
                    "rollout_command": user.command(settings.rollout_command),
                }
            )
        self.host_id = self._hosted[1].shared_host_id if self._hosted is not None else ""
        extra_env = extra_env or {}
        # A multi-worker job's rendezvous.py variables go to the trainer ranks only.
        self._rendezvous = {k: v for k, v in extra_env.items() if k in RENDEZVOUS_KEYS}
        self._extra_env = {k: v for k, v in extra_env.items() if k not in RENDEZVOUS_KEYS}
        self.log = log.bind(job_id=job.job_id, attempt=job.attempt, lease_id=lease_id)

    def stop(self, reason: str) -> None:
        if self._stop_reason is None:
            self._stop_reason = reason
        self._stopped.set()

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    async def until_done(self, holders: Sequence[asyncio.Future[Any]]) -> bool:
        """True once every holder is done; False if this run is stopped first (the holders
        run on: asyncio.wait cancels nothing)."""
        stopped: asyncio.Future[Any] = asyncio.ensure_future(self._stopped.wait())
        try:
            while not stopped.done() and (pending := [h for h in holders if not h.done()]):
                awaited: list[asyncio.Future[Any]] = [*pending, stopped]
                await asyncio.wait(awaited, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        return self._stop_reason is None

    async def run(self) -> Exit:
        ended: Exit | None = None
        try:
            ended = await self._run()
            return ended
        finally:
            failed = ended is None or ended.exit_code != 0
            for process in self._processes:
                if isinstance(process, JobProcess) and failed:
                    process.keep = False  # a failed attempt's processes are not reused
                await process.terminate(self.settings.stop_grace_s)

    async def _run(self) -> Exit:
        launch_path = self.run_dir / "launch.json"
        if refused := self._refused_path():
            self.log.warning("job_path_refused", reason=refused)
            return Exit(1, refused)
        models = Path(self.settings.run_root) / "models"
        self.job, unusable = await with_imported_model(
            self.job, cwd=self.run_dir.resolve(), models_root=models
        )
        if unusable:
            return Exit(1, unusable)
        LaunchConfig.for_job(
            self.job,
            lease_id=self.lease_id,
            device_ids=self.device_ids,
            scheduler_address=self.settings.scheduler_address,
            envhub_address=self.settings.envhub_address,
            run_dir=self.run_dir.resolve(),
            job_token=self.job_token,
            checkpoint_dir=self.settings.checkpoint_dir(self.job.job_id),
        ).write(launch_path)
        env = {
            # The worker's own torch.distributed variables (an agent started under a
            # launcher) must not make a job's processes think they are ranks: ranks get theirs.
            **{k: v for k, v in os.environ.items() if k not in RANK_ENV_KEYS},
            "CUDA_VISIBLE_DEVICES": cuda_visible_devices(self.device_ids),
            "PYTHONUNBUFFERED": "1",
            **self._extra_env,
        }
        if self._user is not None:
            checkpoints = self.settings.checkpoint_dir(self.job.job_id)
            self._user.hand_over(self.run_dir.resolve(), checkpoints)
            env = self._user.env(env, self.run_dir.resolve())
        handover = Handover(
            launch=launch_path.resolve(),
            log_path=(self.run_dir / "rollout.log").resolve(),
            cuda_visible_devices=env["CUDA_VISIBLE_DEVICES"],
        )
        if self._follows_only:  # another worker holds rank 0 and the rollout
            trainer = await self._start_trainer(launch_path, env, handover, rollout_address=None)
            await self._on_launched()
            return await self._supervise(None, trainer)
        if self._hosted is not None:
            return await self._train_hosted(launch_path, env, handover)
        if self.job.spec.kind == common_pb2.JOB_KIND_SFT:  # the trainer alone: no rollout
            trainer = await self._start_trainer(launch_path, env, handover, rollout_address=None)
            await self._on_launched()
            return await self._supervise(None, trainer)
        if self._shared is not None and shares_engine(self.job, self.device_ids):
            base_model = self.job.spec.model.base_model
            shared_address = await self._shared.join(
                self.job.job_id,
                base_model,
                device_ids=self.device_ids,
                rank=self.job.spec.model.lora.rank,
            )
            if shared_address is not None:  # else full: a private rollout, as below
                try:
                    return await self._train_on(shared_address, launch_path, env, handover)
                finally:
                    await self._shared.leave(self.job.job_id, base_model)
            # Not beside a shared GPU rollout it was refused by (device_handover.py)
            if in_the_way := self._shared.make_way(self.job, self.device_ids):
                self.log.warning("private_rollout_waits_for_devices", held_by=sorted(in_the_way))
            if not await self.until_done(list(in_the_way.values())):
                return Exit(-1, f"stopped: {self._stop_reason}")
        return await self._train_with_private_rollout(launch_path, env, handover)

    def _refused_path(self) -> str | None:
        """Why a path of the spec may not be read here (worker/spec_paths.py), or None."""
        roots = [self.settings.run_root, self.settings.checkpoint_dir(self.job.job_id).parent]
        return refused_path(
            self.job.spec, job_id=self.job.job_id, cwd=self.run_dir.resolve(), roots=roots
        )

    @property
    def _ranked(self) -> bool:
        """An RL job on several devices (or a part of one spanning workers): one trainer
        rank per device (ranks.py). Other kinds run one trainer process."""
        rl = self.job.spec.kind == common_pb2.JOB_KIND_RL
        return rl and (len(self.device_ids) > 1 or bool(self._rendezvous))

    @property
    def _follows_only(self) -> bool:
        return self._ranked and self._rendezvous.get("NODE_RANK", "0") != "0"

    async def _train_with_private_rollout(
        self, launch_path: Path, env: dict[str, str], handover: Handover
    ) -> Exit:
        """The rollout and the trainer at once; the trainer reads rollout.addr when it needs
        it. The job counts as launched once the rollout serves (as when the trainer followed)."""
        rollout = await self._start(
            "rollout", [*self.settings.rollout_command, "--launch", str(launch_path)], env, handover
        )
        trainer = await self._start_trainer(
            launch_path, env, handover, rollout_address=None, address_file=self._addr_path
        )
        ended = await self._wait_for_rollout_address(rollout, trainer)
        if ended is not None:
            return ended  # run() ends both processes
        await self._on_launched()
        return await self._supervise(rollout, trainer)

    async def _train_hosted(
        self, launch_path: Path, env: dict[str, str], handover: Handover
    ) -> Exit:
        """Its rollout, and its trainer on the node's shared LoRA host (started if it is not
        running; ended after its last session): watched as a trainer process of its own."""
        assert self._hosted is not None
        hosts, launch = self._hosted
        rollout = await self._start(
            "rollout", [*self.settings.rollout_command, "--launch", str(launch_path)], env, handover
        )
        try:
            host = await hosts.join(
                launch.shared_host_id,
                base_model=self.job.spec.model.base_model,
                device_ids=self.device_ids,
                slots=launch.shared_host_slots,
                env=env,
            )
        except HostStartError as err:
            return Exit(-1, str(err))
        try:
            trainer = HostedTrainer(host, (self.run_dir / "trainer.log").resolve())
            trainer.open(launch_path.resolve(), self._addr_path)
            self._processes.append(trainer)
            self.log.info("hosted_session", host_id=host.host_id, host_pid=host.process.pid)
            ended = await self._wait_for_rollout_address(rollout, trainer)
            if ended is None:
                await self._on_launched()
                ended = await self._supervise(rollout, trainer)
            return Exit(-1, trainer.lost) if trainer.lost else ended
        finally:
            await hosts.leave(host)

    @property
    def _addr_path(self) -> Path:
        return (self.run_dir / "rollout.addr").resolve()

    async def _train_on(
        self, shared_address: str, launch_path: Path, env: dict[str, str], handover: Handover
    ) -> Exit:
        """The trainer alone, against the node's shared rollout (it outlives this job)."""
        self.log.info("shared_rollout", address=shared_address)
        (self.run_dir / "rollout.addr").write_text(f"{shared_address}\n")  # for people and tests
        trainer = await self._start_trainer(
            launch_path, env, handover, rollout_address=shared_address
        )
        await self._on_launched()
        return await self._supervise(None, trainer)

    async def _start_trainer(
        self,
        launch_path: Path,
        env: dict[str, str],
        handover: Handover,
        *,
        rollout_address: str | None,
        address_file: Path | None = None,
    ) -> Proc | RankGroup:
        """The trainer, told its rollout's address (RL), the file the rollout writes it to (a
        private rollout starting beside it), or neither (SFT); several ranks for a job on
        several devices (rank 0 alone opens the rollout)."""
        argv = [*self.settings.trainer_command, "--launch", str(launch_path)]
        if rollout_address is not None:
            argv += ["--rollout-address", rollout_address]
        trainer_wait_s = None
        if address_file is not None:
            # The worker judges the rollout's start; the trainer waits longer, so a late
            # rollout ends the attempt with the worker's reason (re-queued), not the trainer's.
            trainer_wait_s = self.settings.rollout_start_timeout_s + TRAINER_WAIT_GRACE_S
            argv += ["--rollout-address-file", str(address_file)]
            argv += ["--rollout-address-timeout", f"{trainer_wait_s:g}"]
        if self._ranked:
            return await self._start_ranks(argv, env)
        update = {
            "log_path": (self.run_dir / "trainer.log").resolve(),
            "rollout_address": rollout_address or "",
            "rollout_address_file": address_file,
            "rollout_address_timeout_s": trainer_wait_s,
        }
        return await self._start("trainer", argv, env, handover.model_copy(update=update))

    async def _start_ranks(self, argv: list[str], env: dict[str, str]) -> RankGroup:
        """One trainer process per local device: trainer.log for global rank 0, else
        trainer-rank<R>.log."""
        ranks: list[ManagedProcess] = []
        envs = rank_envs(max(len(self.device_ids), 1), self._rendezvous)
        for rank_env in envs:
            rank = int(rank_env["RANK"])
            name = "trainer" if rank == 0 else f"trainer-rank{rank}"
            process = await ManagedProcess.start(
                name,
                argv,
                log_path=self.run_dir / f"{name}.log",
                env={**env, **rank_env},
                cwd=self.run_dir,
            )
            self._processes.append(process)
            ranks.append(process)
            write_atomic(self.run_dir / f"{name}.pid", f"{process.pid}\n")
        self.log.info("trainer_ranks_started", world_size=envs[0]["WORLD_SIZE"], local=len(envs))
        return RankGroup(ranks)

    async def _start(
        self, name: str, argv: list[str], env: dict[str, str], handover: Handover
    ) -> Proc:
        """A warm spare of this job's base model handed the job, else a fresh process."""
        process = await self._take_spare(name, handover)
        if process is None:
            process = await ManagedProcess.start(
                name, argv, log_path=self.run_dir / f"{name}.log", env=env, cwd=self.run_dir
            )
        self._processes.append(process)
        # for people and tests: whoever sees the file reads the whole pid
        write_atomic(self.run_dir / f"{name}.pid", f"{process.pid}\n")
        return process

    async def _take_spare(self, name: str, handover: Handover) -> Proc | None:
        if self._spares is None:
            return None
        reusable = reusable_job(self.job, ranked=self._ranked) and self._spares.reuse
        return await hand_to_spare(self._spares, name, self.job, handover, reusable, self.log)

    async def _wait_for_rollout_address(
        self, rollout: Proc, trainer: Proc | RankGroup
    ) -> Exit | None:
        """None once the rollout has written rollout.addr; else how the attempt ended: the
        rollout died or was late, the run was stopped, or the trainer exited first."""
        timeout_s = self.settings.rollout_start_timeout_s
        # wait_for_file polls in a worker thread; this flag (thread-safe, unlike the event
        # loop's view of the processes) ends it as soon as either process exits, the run is
        # stopped, or this coroutine is abandoned, so no thread outlives the attempt.
        give_up = threading.Event()
        rollout_exited = asyncio.create_task(rollout.wait())
        watched = [rollout_exited, asyncio.create_task(trainer.wait())]
        watched.append(asyncio.create_task(self._stopped.wait()))
        for task in watched:
            task.add_done_callback(lambda _: give_up.set())
        try:
            await asyncio.to_thread(
                wait_for_file,
                self._addr_path,
                timeout_s=timeout_s,
                alive=lambda: not give_up.is_set(),
            )
            return None
        except TimeoutError:
            return Exit(-1, f"rollout did not write rollout.addr within {timeout_s:.0f} s")
        except RuntimeError:
            if self._stop_reason is not None:
                return Exit(-1, f"stopped: {self._stop_reason}")
            if rollout_exited.done():
                code = await rollout.wait()
                return Exit(code or -1, died("rollout", code, rollout, "before it was ready"))
            # The trainer exited first: reported as ever (its own reason, or how it was killed).
            return await self._supervise(rollout, trainer, when="while its rollout started")
        finally:
            give_up.set()
            for task in watched:
                task.cancel()

    async def _supervise(
        self,
        rollout: Proc | None,
        trainer: Proc | RankGroup,
        *,
        when: str = "while it trained",
    ) -> Exit:
        """Until the trainer exits, the run is stopped, or the rollout (if any) dies. ``when``:
        what the trainer was doing, said of a trainer killed or a follower failed."""
        waits = {
            asyncio.create_task(trainer.wait()): "trainer",
            asyncio.create_task(self._stopped.wait()): "stop",
        }
        if rollout is not None:
            waits[asyncio.create_task(rollout.wait())] = "rollout"
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        first = {waits[task] for task in done}
        grace = self.settings.stop_grace_s
        if "trainer" in first:
            code = trainer.returncode if trainer.returncode is not None else -1
            if isinstance(rollout, JobProcess) and code != 0:
                rollout.keep = False  # the attempt failed: its rollout is not reused
            if rollout is not None:
                if code > 0 and (
                    lost := await rollout_lost(
                        rollout,
                        trainer,
                        address_file=self._addr_path,
                        timeout_s=self.settings.liveness_timeout_s,
                    )
                ):
                    return lost
                await rollout.terminate(grace)
            reason = "" if code == 0 else last_meaningful_line(trainer.log_path)
            culprit = "trainer"
            if isinstance(trainer, RankGroup):
                await trainer.terminate(grace)  # the other ranks: they cannot go on alone
                culprit = trainer.name  # a follower that failed is named (trainer-rank1)
            # Killed, or a follower failed: say so (rank 0 reports its own failures).
            if code < 0 or (code != 0 and culprit != "trainer"):
                reason = died(culprit, code, trainer, when)
            self.log.info("trainer_exited", exit_code=code)
            return Exit(code, reason)
        if "stop" in first:
            code = await trainer.terminate(grace)
            if rollout is not None:
                await rollout.terminate(grace)
            return Exit(code, f"stopped: {self._stop_reason}")
        assert rollout is not None  # "rollout" is only waited on when there is one
        rollout_code = rollout.returncode if rollout.returncode is not None else -1
        if rollout_code == PEER_LOST:
            return await trainer_lost(
                rollout, trainer, when, grace_s=self.settings.peer_lost_grace_s
            )
        await trainer.terminate(grace)
        return Exit(
            rollout_code or -1,
            died("rollout", rollout_code, rollout, "while the trainer ran"),
        )
