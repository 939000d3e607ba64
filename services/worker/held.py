"""What a worker agent holds across its connections to the scheduler.

A job's processes outlive a dropped stream (a scheduler restart, a network blip): the agent
keeps them running, and on every registration announces what it holds (RegisterWorker.held) —
the attempts still running, and the attempts that ended recently — then sends the JobExited of
each ended one. An exit is kept ``retention_s`` after it was last sent, because a write that
succeeded on a stream that then broke may never have been read; sending it again is harmless
(the scheduler ignores the exit of an attempt that is no longer active).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.worker.job_run import Exit, JobRun

AttemptKey = tuple[str, int]  # (job_id, attempt)


@dataclass
class HeldRun:
    """One attempt running here. ``orphaned``: stopped because no scheduler could be reached
    for too long; its exit is not reported (the scheduler re-queues the job itself)."""

    run: JobRun
    task: asyncio.Task[None]
    launched: bool = False
    orphaned: bool = False


@dataclass
class PendingExit:
    """How an attempt ended, until it is known (or assumed) to have reached the scheduler."""

    lease_id: str
    launched: bool
    exit: Exit
    sent_at: float | None = None  # monotonic; None = still to send on the current stream


class HeldAttempts:
    def __init__(self, *, retention_s: float) -> None:
        self.retention_s = retention_s
        self.runs: dict[AttemptKey, HeldRun] = {}
        self.exits: dict[AttemptKey, PendingExit] = {}

    def matching(self, job_id: str, attempt: int = 0) -> list[HeldRun]:
        """Runs of the job (of that attempt; 0 = any)."""
        return [
            held
            for (held_job, held_attempt), held in self.runs.items()
            if held_job == job_id and attempt in (0, held_attempt)
        ]

    def record_exit(self, key: AttemptKey, held: HeldRun, outcome: Exit) -> None:
        self.exits[key] = PendingExit(held.run.lease_id, held.launched, outcome)

    def announce(self) -> list[scheduler_pb2.HeldAttempt]:
        """Everything to announce on a new registration; every kept exit is to be sent again."""
        now = time.monotonic()
        for key, pending in list(self.exits.items()):
            if pending.sent_at is not None and now - pending.sent_at > self.retention_s:
                del self.exits[key]
            else:
                pending.sent_at = None
        running = [
            scheduler_pb2.HeldAttempt(
                job_id=job_id, attempt=attempt, lease_id=held.run.lease_id, launched=held.launched
            )
            for (job_id, attempt), held in self.runs.items()
            if not held.orphaned
        ]
        ended = [
            scheduler_pb2.HeldAttempt(
                job_id=job_id,
                attempt=attempt,
                lease_id=pending.lease_id,
                launched=pending.launched,
                exited=True,
            )
            for (job_id, attempt), pending in self.exits.items()
        ]
        return running + ended

    def unsent(self) -> list[tuple[AttemptKey, PendingExit]]:
        return [(key, pending) for key, pending in self.exits.items() if pending.sent_at is None]
