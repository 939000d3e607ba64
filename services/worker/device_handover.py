"""A launch on devices that earlier processes still hold waits until they are gone.

The scheduler holds a stopped attempt's devices until its worker reports the exit (draining.py),
but a worker can hold processes the scheduler does not know about:
- attempts it stopped itself after no scheduler was reachable for ``orphan_grace_s`` (it does
  not announce those), or strays of a lease that lapsed and was released while the worker was
  away (told to stop when it registers again): their devices are free in the ledger while the
  processes are still in their SIGTERM grace;
- a shared LoRA rollout (shared_rollouts.py) runs on the GPUs of the job that started it, and
  outlives that job while other jobs use it: the ledger frees those GPUs when the job ends.
The next dispatch round may place a job there; on a GPU, a CUDA out-of-memory, or vLLM sizing
``gpu_memory_utilization`` against memory not yet freed. The worker knows what its processes
hold, so it starts an attempt only once every earlier run on any of its devices has ended, and
any shared GPU rollout there has stopped, unless the attempt may join that rollout itself (a
LoRA job of its base; that rollout then takes no new jobs, so the wait ends with the jobs it
has). A stop that comes meanwhile ends the attempt unstarted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping

import structlog

from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.worker.held import AttemptKey, HeldRun
from opentinker.services.worker.job_run import Exit, JobRun
from opentinker.services.worker.shared_rollouts import SharedRollouts

log = structlog.get_logger(__name__)

Holders = dict[str, "asyncio.Future[None]"]  # what holds the devices -> done when it is gone
SAY_TIMEOUT_S = 5.0
Say = Callable[..., Awaitable[None]]  # the worker's stream: say(waiting=JobWaiting(...))


def holders_of(
    run: JobRun, runs: Mapping[AttemptKey, HeldRun], shared: SharedRollouts | None
) -> Holders:
    """The runs here, and the shared GPU rollouts ``run`` would not join, on its devices.
    Sessions of one shared LoRA host share its device by design (trainer_hosts.py): they do
    not wait for each other."""
    wanted = set(run.device_ids)
    holders: Holders = {
        f"{job_id}/{attempt}": held.task
        for (job_id, attempt), held in runs.items()
        if wanted & set(held.run.device_ids)
        and not (run.host_id and held.run.host_id == run.host_id)
    }
    if shared is not None:
        holders.update(shared.make_way(run.job, run.device_ids))
    return {name: done for name, done in holders.items() if not done.done()}


async def run_when_free(run: JobRun, holders: Holders, *, say: Say) -> Exit:
    """``run.run()`` once every holder is gone; its stop meanwhile ends it unstarted. ``say``
    sends the scheduler a message (here JobWaiting, for the job's events)."""
    if holders:
        run.log.warning(
            "launch_waits_for_devices", devices=list(run.device_ids), held_by=sorted(holders)
        )
        devices, held_by = ", ".join(run.device_ids), ", ".join(sorted(holders))
        why = f"waiting for its devices ({devices}), still held here by {held_by}"
        job = run.job
        if run.stop_reason is None:  # lost with the stream when there is none (informative)
            waiting = scheduler_pb2.JobWaiting(job_id=job.job_id, attempt=job.attempt, reason=why)
            # Bounded: a stream stuck in its write must not hold the wait (nor a stop) up
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(say(waiting=waiting), SAY_TIMEOUT_S)
        if not await run.until_done(list(holders.values())):
            return Exit(-1, f"stopped: {run.stop_reason}")
        run.log.info("devices_freed")
    if run.stop_reason is not None:
        return Exit(-1, f"stopped: {run.stop_reason}")
    return await run.run()
