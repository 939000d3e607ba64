"""A reusable warm spare seen as one job's process (modeling/spare.py, ``serve_jobs``).

The job run (job_run.py) watches its processes by ``wait``, ``returncode``, ``running`` and
ends them with ``terminate``. A reusable spare does not exit at the end of its job: it
reports ``{"ended": code}`` on its report pipe and waits for the next hand-over. ``JobProcess``
gives the job run that end as if it were an exit, and its ``terminate`` hands a process whose
job ended well back to the pool (``give_back``) instead of killing it. A rollout, which serves
until told to stop, is told with SIGUSR1 ("job over, stay"); a trainer ends by itself. Any
other end (a stop, a failure, a process that does not report within the grace) kills the
process as before: only a clean end is ever reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path

import structlog

from opentinker.common.v1 import common_pb2
from opentinker.services.modeling.spare import Handover
from opentinker.services.worker.spares import SparePool
from opentinker.services.worker.supervisor import ManagedProcess

log = structlog.get_logger(__name__)


class JobProcess:
    """One job's view of a reusable spare: it "exits" when it reports the job's end."""

    def __init__(
        self, kind: str, process: ManagedProcess, give_back: Callable[[ManagedProcess], None]
    ) -> None:
        self.process = process
        self.name = kind  # "rollout" or "trainer"
        self._give_back = give_back
        self._given_back = False
        self.keep = True  # False: the job failed; whatever it left is not reused
        self._ended = asyncio.ensure_future(process.next_report())
        self._code: int | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    @property
    def returncode(self) -> int | None:
        return self._code if self._code is not None else self.process.returncode

    @property
    def running(self) -> bool:
        return self._code is None and self.process.running

    async def wait(self) -> int:
        """The job's exit code: the one reported at its end, or the process's own."""
        if self._code is None:
            exited = asyncio.ensure_future(self.process.wait())
            try:
                await asyncio.wait({self._ended, exited}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                exited.cancel()
            report = _result(self._ended)
            if report is None or "ended" not in report:
                return await self.process.wait()
            self._code = int(report["ended"])
        return self._code

    async def terminate(self, grace_s: float) -> int:
        """A job that ended well gives its process back to the pool; a rollout still serving
        is told its job is over (SIGUSR1) and given ``grace_s`` to end it. Anything else is
        killed as a ManagedProcess is."""
        if self._given_back:  # the pool's now: a second terminate (run()'s finally) is a no-op
            return 0
        if self.keep and self._code is None and self.process.running and self.name == "rollout":
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGUSR1)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.wait()), timeout=grace_s)
        if self._code == 0 and self.keep and self.process.running:
            self._given_back = True
            self._give_back(self.process)
            return 0
        self._ended.cancel()
        code = await self.process.terminate(grace_s)
        return self._code if self._code is not None else code


def _result(report: asyncio.Future[dict | None]) -> dict | None:
    """What the process reported, or None (not yet, cancelled, unreadable)."""
    if not report.done() or report.cancelled() or report.exception() is not None:
        return None
    return report.result()


def reusable_job(job: common_pb2.Job, *, ranked: bool) -> bool:
    """May this job's spares serve its tenant's next job? RL and SFT jobs of one trainer
    process (not ``ranked``) of a known tenant."""
    kinds = (common_pb2.JOB_KIND_RL, common_pb2.JOB_KIND_SFT)
    return job.spec.kind in kinds and not ranked and bool(job.tenant_id)


async def hand_to_spare(
    spares: SparePool,
    name: str,
    job: common_pb2.Job,
    handover: Handover,
    reusable: bool,
    log: structlog.typing.FilteringBoundLogger,
) -> ManagedProcess | JobProcess | None:
    """A spare of the job's base model handed the job (None: start cold). A ``reusable`` job
    gets one that served its tenant before if any, and keeps it after a clean end."""
    base_model = job.spec.model.base_model
    if not base_model:
        return None
    # A used process goes only to the same tenant on the same devices: one that has used CUDA
    # cannot change its visible devices (modeling/spare.py adopt would refuse the job).
    tenant = f"{job.tenant_id}@{handover.cuda_visible_devices}" if reusable else ""
    spare = spares.take(name, base_model, tenant=tenant)
    if spare is None:
        log.info("cold_start", process=name)
        return None
    line = handover.model_copy(update={"reusable": reusable}).line()
    try:
        await spare.hand_over(line, handover.log_path, keep_open=reusable)
    except (BrokenPipeError, ConnectionResetError) as err:  # it died just now: start cold
        log.warning("spare_lost", process=name, pid=spare.pid, error=repr(err))
        await spare.terminate(0)
        return None
    log.info("warm_start", process=name, pid=spare.pid, reusable=reusable)
    if not reusable:
        return spare
    limit = spares.kept_limit(on_cpu=not handover.cuda_visible_devices)
    return JobProcess(
        name, spare, lambda p: spares.give_back(name, base_model, tenant, p, limit=limit)
    )
