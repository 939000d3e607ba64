"""Jobs as the scheduler keeps them, and what each attempt of a job reported.

A job is a ``common_pb2.Job`` stored serialized. Its ``state`` only moves along the life cycle
QUEUED → ALLOCATING → RUNNING → SUCCEEDED | FAILED | CANCELLED (plus back to QUEUED when its
worker is lost); terminal states are final and every other move raises IllegalTransitionError
(job_lifecycle.py: the states, the allowed moves, the check).

Redis layout (``prefix`` defaults to ``ot:jobs``)::

    <prefix>:job:<job_id>                 STRING serialized common_pb2.Job
    <prefix>:index                        ZSET job id -> creation number (newest = highest)
    <prefix>:index:tenant:<tenant_id>     ZSET the same, for one tenant's jobs
    <prefix>:counter                      STRING creation counter
    <prefix>:request:<tenant>:<request_id>  STRING job id of the tenant's first SubmitJob with
                                          that id (request ids of tenants never collide)
    <prefix>:job:<job_id>:attempt:<n>     HASH failure, result, last_step, lost of attempt n
    <prefix>:opened-by                    HASH job id -> key prefix of the API key that opened
                                          the session job, while it has not ended (written
                                          with the job, removed with its last transition:
                                          revoked_sessions.py ends it when that key is revoked)

A job moved back to QUEUED is put at the front of the job queue (job_queue.py, ``queue_key``)
in the same transaction, so no outage or crash can leave it QUEUED outside the queue.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from opentinker.common.v1 import common_pb2
from opentinker.errors import ConfigError
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.scheduler.errors import JobNotFoundError, StaleAttemptError
from opentinker.services.scheduler.jobs.job_lifecycle import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    JobState,
    check_transition,
)
from opentinker.services.scheduler.redis_text import as_text

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000


@dataclass(frozen=True)
class JobPage:
    jobs: list[common_pb2.Job]  # newest first
    next_page_token: str  # empty on the last page


@dataclass(frozen=True)
class AttemptReport:
    """What the job's own processes reported during one attempt."""

    failure_reason: str = ""
    result: scheduler_pb2.JobResult | None = None
    last_step: common_pb2.StepMetrics | None = None
    # Why the scheduler lost the attempt (its worker lost, a process of it killed), when it did.
    lost_reason: str = ""
    # A session job's trainer: why the session ended ("closed", "idle timeout"), when it did.
    session_end: str = ""


class JobStore(Protocol):
    """Persistent jobs. ``transition`` is atomic against concurrent writers."""

    async def create(
        self,
        spec: common_pb2.JobSpec,
        *,
        request_id: str = "",
        tenant_id: str = "",
        owner_user_id: str = "",
        opened_by: str = "",
    ) -> tuple[common_pb2.Job, bool]:
        """Store a new QUEUED job of ``tenant_id`` and append it to the job queue, in one
        step (no crash or outage can leave it stored but outside the queue); returns (job,
        created). A repeated request_id of the same tenant returns the first job and
        created=False. ``opened_by``: the key prefix of the API key that opened a session job,
        kept in the same step until the job ends (``session_openers``)."""

    async def get(self, job_id: str) -> common_pb2.Job:
        """The job; raises JobNotFoundError."""

    async def get_many(self, job_ids: Sequence[str]) -> list[common_pb2.Job | None]:
        """The jobs, in order, in one round trip; None for an id with no job."""

    async def list_jobs(
        self, *, page_size: int = 0, page_token: str = "", tenant_id: str | None = None
    ) -> JobPage:
        """Jobs newest first, of one tenant or (None) of all; ConfigError for a malformed
        page_token."""

    async def transition(
        self,
        job_id: str,
        to: JobState,
        *,
        reason: str = "",
        expect_attempt: int | None = None,
        worker_id: str | None = None,
        worker_ids: Sequence[str] = (),
        next_attempt: bool = False,
        result: scheduler_pb2.JobResult | None = None,
        queue_front: bool = False,
    ) -> common_pb2.Job:
        """Move the job to ``to`` with ``reason``; ``queue_front`` also puts it at the front of
        the job queue, in the same transaction. ``expect_attempt`` guards against stale
        messages (StaleAttemptError); ``worker_id`` sets the worker (and ``worker_ids`` every
        worker of a multi-worker placement, rank 0 first); ``next_attempt`` counts one
        more launch; ``result`` sets checkpoint_uri and final_metrics. Raises
        IllegalTransitionError for a move the life cycle forbids."""

    async def record_failure(self, job_id: str, attempt: int, reason: str) -> None: ...

    async def active_ids(self) -> list[str]:
        """The jobs ALLOCATING or RUNNING (kept with every transition; unleased.py)."""
        ...

    async def session_openers(self) -> dict[str, str]:
        """Job id -> key prefix of the API key that opened it, for each session job created
        with ``opened_by`` that has not ended (revoked_sessions.py)."""
        ...

    async def record_lost(self, job_id: str, attempt: int, reason: str) -> None:
        """Note why the attempt was lost (kept as the job's history of attempts)."""

    async def record_result(
        self, job_id: str, attempt: int, result: scheduler_pb2.JobResult
    ) -> None: ...

    async def record_step(
        self, job_id: str, attempt: int, step: common_pb2.StepMetrics
    ) -> None: ...

    async def record_session_end(self, job_id: str, attempt: int, reason: str) -> None: ...

    async def set_endpoint(self, job_id: str, attempt: int, endpoint: str) -> common_pb2.Job:
        """Publish a session's address in its Job while ``attempt`` is its current one;
        StaleAttemptError otherwise. Cleared when the job leaves RUNNING."""

    async def report(self, job_id: str, attempt: int) -> AttemptReport:
        """Everything recorded for that attempt (empty when nothing was)."""


_CREATE = """
if ARGV[3] == '1' then
  local existing = redis.call('GET', KEYS[4])
  if existing then return existing end
end
local n = redis.call('INCR', KEYS[3])
redis.call('SET', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], n, ARGV[1])
redis.call('ZADD', KEYS[5], n, ARGV[1])
if ARGV[3] == '1' then redis.call('SET', KEYS[4], ARGV[1]) end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[7], ARGV[1], ARGV[4]) end
redis.call('RPUSH', KEYS[6], ARGV[1])
return ARGV[1]
"""


class RedisJobStore:
    """JobStore on one Redis."""

    def __init__(
        self, client: aioredis.Redis, *, prefix: str = "ot:jobs", queue_key: str = "ot:queue"
    ) -> None:
        self._r = client
        self._prefix = prefix
        self._queue_key = queue_key  # the RedisJobQueue's list, on the same Redis
        self._create = client.register_script(_CREATE)

    def _key(self, *parts: str) -> str:
        return ":".join((self._prefix, *parts))

    async def create(
        self,
        spec: common_pb2.JobSpec,
        *,
        request_id: str = "",
        tenant_id: str = "",
        owner_user_id: str = "",
        opened_by: str = "",
    ) -> tuple[common_pb2.Job, bool]:
        now = time.time()
        job = common_pb2.Job(
            job_id=f"job-{uuid.uuid4().hex[:12]}",
            spec=spec,
            state=common_pb2.JOB_STATE_QUEUED,
            reason="submitted",
            created_unix_s=now,
            updated_unix_s=now,
            tenant_id=tenant_id,
            owner_user_id=owner_user_id,
        )
        stored_id = await self._create(
            keys=[
                self._key("job", job.job_id),
                self._key("index"),
                self._key("counter"),
                self._key("request", tenant_id, request_id or "-"),
                self._key("index", "tenant", tenant_id),
                self._queue_key,
                self._key("opened-by"),
            ],
            args=[job.job_id, job.SerializeToString(), "1" if request_id else "0", opened_by],
        )
        stored_id = stored_id.decode() if isinstance(stored_id, bytes) else stored_id
        if stored_id != job.job_id:
            return await self.get(stored_id), False
        return job, True

    async def get(self, job_id: str) -> common_pb2.Job:
        raw = await self._r.get(self._key("job", job_id))
        if raw is None:
            raise JobNotFoundError.for_id(job_id)
        return common_pb2.Job.FromString(raw)

    async def get_many(self, job_ids: Sequence[str]) -> list[common_pb2.Job | None]:
        if not job_ids:
            return []
        raws = await self._r.mget([self._key("job", job_id) for job_id in job_ids])
        return [common_pb2.Job.FromString(raw) if raw is not None else None for raw in raws]

    async def list_jobs(
        self, *, page_size: int = 0, page_token: str = "", tenant_id: str | None = None
    ) -> JobPage:
        index = self._key("index") if tenant_id is None else self._key("index", "tenant", tenant_id)
        size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        if size < 0:
            raise ConfigError(f"page_size must be >= 0, got {page_size}", reason="INVALID_PAGE")
        if page_token and not page_token.isdigit():
            raise ConfigError(
                f"page_token {page_token!r} is not one this server issued; "
                "pass the next_page_token of the previous ListJobs answer",
                reason="INVALID_PAGE_TOKEN",
            )
        top = f"({page_token}" if page_token else "+inf"
        rows: list[Any] = await self._r.zrevrangebyscore(
            index, top, "-inf", start=0, num=size + 1, withscores=True
        )
        page = rows[:size]
        jobs = []
        if page:
            raws = await self._r.mget([self._key("job", as_text(row[0])) for row in page])
            jobs = [common_pb2.Job.FromString(raw) for raw in raws if raw is not None]
        next_token = str(int(page[-1][1])) if len(rows) > size else ""
        return JobPage(jobs=jobs, next_page_token=next_token)

    async def transition(
        self,
        job_id: str,
        to: JobState,
        *,
        reason: str = "",
        expect_attempt: int | None = None,
        worker_id: str | None = None,
        worker_ids: Sequence[str] = (),
        next_attempt: bool = False,
        result: scheduler_pb2.JobResult | None = None,
        queue_front: bool = False,
    ) -> common_pb2.Job:
        key = self._key("job", job_id)
        async with self._r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None:
                        raise JobNotFoundError.for_id(job_id)
                    job = common_pb2.Job.FromString(raw)
                    check_transition(job, to, expect_attempt)
                    job.state = to
                    job.reason = reason
                    if to != common_pb2.JOB_STATE_RUNNING:  # a session serves only while running
                        job.endpoint = ""
                    job.updated_unix_s = time.time()
                    if worker_id is not None:  # a new placement (or none): its workers too
                        job.worker_id = worker_id
                        del job.worker_ids[:]
                        job.worker_ids.extend(worker_ids)
                    if next_attempt:
                        job.attempt += 1
                    if result is not None:
                        job.checkpoint_uri = result.checkpoint_uri
                        job.final_metrics.clear()
                        job.final_metrics.update(result.final_metrics)
                    pipe.multi()
                    pipe.set(key, job.SerializeToString())
                    if to in ACTIVE_STATES:
                        pipe.sadd(self._key("active"), job_id)
                    else:
                        pipe.srem(self._key("active"), job_id)
                    if to in TERMINAL_STATES:
                        pipe.hdel(self._key("opened-by"), job_id)
                    if queue_front:
                        pipe.lrem(self._queue_key, 0, job_id)
                        pipe.lpush(self._queue_key, job_id)
                    await pipe.execute()
                    return job
                except WatchError:
                    continue  # someone else wrote the job between our read and write: retry

    async def active_ids(self) -> list[str]:
        return sorted(as_text(i) for i in await self._r.smembers(self._key("active")))

    async def session_openers(self) -> dict[str, str]:
        opened = await self._r.hgetall(self._key("opened-by"))
        return {as_text(job_id): as_text(prefix) for job_id, prefix in opened.items()}

    async def record_failure(self, job_id: str, attempt: int, reason: str) -> None:
        await self._r.hset(self._key("job", job_id, "attempt", str(attempt)), "failure", reason)

    async def record_lost(self, job_id: str, attempt: int, reason: str) -> None:
        await self._r.hset(self._key("job", job_id, "attempt", str(attempt)), "lost", reason)

    async def record_result(
        self, job_id: str, attempt: int, result: scheduler_pb2.JobResult
    ) -> None:
        await self._r.hset(
            self._key("job", job_id, "attempt", str(attempt)), "result", result.SerializeToString()
        )

    async def record_step(self, job_id: str, attempt: int, step: common_pb2.StepMetrics) -> None:
        await self._r.hset(
            self._key("job", job_id, "attempt", str(attempt)), "last_step", step.SerializeToString()
        )

    async def record_session_end(self, job_id: str, attempt: int, reason: str) -> None:
        await self._r.hset(self._key("job", job_id, "attempt", str(attempt)), "session_end", reason)

    async def set_endpoint(self, job_id: str, attempt: int, endpoint: str) -> common_pb2.Job:
        key = self._key("job", job_id)
        async with self._r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None:
                        raise JobNotFoundError.for_id(job_id)
                    job = common_pb2.Job.FromString(raw)
                    if job.attempt != attempt or job.state in TERMINAL_STATES:
                        raise StaleAttemptError(
                            f"job {job_id!r} is not at a live attempt {attempt}",
                            reason="STALE_ATTEMPT",
                        )
                    job.endpoint = endpoint
                    pipe.multi()
                    pipe.set(key, job.SerializeToString())
                    await pipe.execute()
                    return job
                except WatchError:
                    continue  # the job changed between our read and write: retry

    async def report(self, job_id: str, attempt: int) -> AttemptReport:
        fields: Mapping[Any, Any] = await self._r.hgetall(
            self._key("job", job_id, "attempt", str(attempt))
        )
        result = fields.get(b"result")
        step = fields.get(b"last_step")
        return AttemptReport(
            failure_reason=fields.get(b"failure", b"").decode(),
            result=scheduler_pb2.JobResult.FromString(result) if result is not None else None,
            last_step=common_pb2.StepMetrics.FromString(step) if step is not None else None,
            lost_reason=fields.get(b"lost", b"").decode(),
            session_end=fields.get(b"session_end", b"").decode(),
        )
