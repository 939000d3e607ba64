"""Every change of a job's state goes through here: the store, the event log, the job tokens."""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.scheduler.errors import IllegalTransitionError, StaleAttemptError
from opentinker.services.scheduler.jobs.event_log import EventLog, state_change
from opentinker.services.scheduler.jobs.job_lifecycle import ACTIVE_STATES, JobState, state_name
from opentinker.services.scheduler.jobs.job_store import JobStore
from opentinker.services.scheduler.tenants.identity import IdentityStore

log = structlog.get_logger(__name__)


class JobStates:
    def __init__(self, jobs: JobStore, events: EventLog, identity: IdentityStore) -> None:
        self._jobs = jobs
        self._events = events
        self._identity = identity

    async def change(
        self,
        job_id: str,
        to: JobState,
        reason: str,
        *,
        expect_attempt: int | None = None,
        worker_id: str | None = None,
        worker_ids: Sequence[str] = (),
        next_attempt: bool = False,
        result: scheduler_pb2.JobResult | None = None,
        queue_front: bool = False,
    ) -> common_pb2.Job:
        """Move the job to ``to`` (JobStore.transition), write the state_change event, and
        revoke the job tokens of an attempt that is over. Raises what the store raises."""
        try:
            job = await self._jobs.transition(
                job_id,
                to,
                reason=reason,
                expect_attempt=expect_attempt,
                worker_id=worker_id,
                worker_ids=worker_ids,
                next_attempt=next_attempt,
                result=result,
                queue_front=queue_front,
            )
        except (IllegalTransitionError, StaleAttemptError) as err:
            log.info("transition_skipped", job_id=job_id, to=state_name(to), why=str(err))
            raise
        if to not in ACTIVE_STATES:  # the attempt is over: its processes lose their credential
            await self._identity.revoke_job_tokens(job_id)
        await self._events.append(job_id, state_change(to, reason))
        log.info("job_state", job_id=job_id, state=state_name(to), reason=reason)
        return job
