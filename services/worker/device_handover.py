"""A launch on devices an earlier attempt's processes still hold waits until they exit.

The scheduler holds a stopped attempt's devices until its worker reports the exit (draining.py),
but a worker can hold processes the scheduler no longer knows about: attempts it stopped itself
after no scheduler was reachable for ``orphan_grace_s`` (it does not announce those), or strays
of a lease that lapsed and was released while the worker was away (told to stop when it
registers again). Their devices are free in the ledger, so the next dispatch round may place a
job on them while the old processes are still in their SIGTERM grace: on a GPU, a CUDA
out-of-memory, or vLLM sizing ``gpu_memory_utilization`` against memory not yet freed. The
worker knows what its processes hold, so it starts an attempt only once every earlier run on
any of its devices has ended; a stop that comes meanwhile ends the attempt unstarted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import structlog

from opentinker.services.worker.held import AttemptKey, HeldRun
from opentinker.services.worker.job_run import Exit, JobRun

log = structlog.get_logger(__name__)


def holders_of(device_ids: Sequence[str], runs: Mapping[AttemptKey, HeldRun]) -> list[HeldRun]:
    """The runs here that hold any of ``device_ids``."""
    wanted = set(device_ids)
    return [held for held in runs.values() if wanted & set(held.run.device_ids)]


async def run_when_free(run: JobRun, holders: Sequence[HeldRun]) -> Exit:
    """``run.run()`` once every holder's processes have exited; its stop meanwhile ends it."""
    waiting = [held.task for held in holders if not held.task.done()]
    if waiting:
        run.log.warning(
            "launch_waits_for_devices",
            devices=sorted({d for h in holders for d in h.run.device_ids} & set(run.device_ids)),
            held_by=[f"{h.run.job.job_id}/{h.run.job.attempt}" for h in holders],
        )
        await _until_done_or_stopped(run, waiting)
    if run.stop_reason is not None:
        return Exit(-1, f"stopped: {run.stop_reason}")
    if waiting:
        run.log.info("devices_freed")
    return await run.run()


async def _until_done_or_stopped(run: JobRun, tasks: list[asyncio.Task[None]]) -> None:
    stopped = asyncio.ensure_future(run.until_stopped())
    try:
        while not stopped.done() and (pending := [t for t in tasks if not t.done()]):
            # asyncio.wait never cancels what it waits for: the holders' tasks run on
            await asyncio.wait([*pending, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
