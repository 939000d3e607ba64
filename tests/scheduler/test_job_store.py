"""Contract tests of JobStore, JobQueue and EventLog, run against every implementation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import redis.asyncio as aioredis

from opentinker.common.v1 import common_pb2
from opentinker.errors import ConfigError
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.scheduler.errors import (
    IllegalTransitionError,
    JobNotFoundError,
    StaleAttemptError,
)
from opentinker.services.scheduler.jobs.event_log import RedisEventLog, state_change
from opentinker.services.scheduler.jobs.job_queue import RedisJobQueue
from opentinker.services.scheduler.jobs.job_store import RedisJobStore
from opentinker.services.scheduler.stores import Stores, redis_stores
from opentinker.spec import JobSpec, RlConfig, to_proto

pytestmark = pytest.mark.integration

Q = common_pb2.JOB_STATE_QUEUED
A = common_pb2.JOB_STATE_ALLOCATING
R = common_pb2.JOB_STATE_RUNNING
S = common_pb2.JOB_STATE_SUCCEEDED
F = common_pb2.JOB_STATE_FAILED
C = common_pb2.JOB_STATE_CANCELLED


@pytest.fixture(params=["redis"])
def make_stores(request: pytest.FixtureRequest, redis_url: str):
    """``async with make_stores() as stores`` gives a fresh Stores of one implementation."""

    @asynccontextmanager
    async def redis_impl() -> AsyncIterator[Stores]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            stores = redis_stores(client, lease_ttl_s=10.0, server_secret=b"t" * 32)
            assert isinstance(stores.jobs, RedisJobStore)
            assert isinstance(stores.queue, RedisJobQueue)
            assert isinstance(stores.events, RedisEventLog)
            yield stores
        finally:
            await client.aclose()

    return {"redis": redis_impl}[request.param]


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro_fn())


def spec(name: str = "job") -> common_pb2.JobSpec:
    return to_proto(JobSpec(name=name, rl=RlConfig(env_name="letters", steps=3)))


# ---- JobStore ---------------------------------------------------------------------------------


def test_create_get_and_request_id_idempotency(make_stores) -> None:
    async def main() -> None:
        async with make_stores() as stores:
            job, created = await stores.jobs.create(spec("a"), request_id="req-1")
            assert created and job.state == Q and job.attempt == 0
            again, created_again = await stores.jobs.create(spec("other"), request_id="req-1")
            assert not created_again
            assert again.job_id == job.job_id and again.spec.name == "a"
            other, _ = await stores.jobs.create(spec("b"))
            assert other.job_id != job.job_id
            assert (await stores.jobs.get(job.job_id)).spec.name == "a"
            with pytest.raises(JobNotFoundError, match="job 'nope' not found"):
                await stores.jobs.get("nope")

    run(main)


def test_list_is_newest_first_and_paginated(make_stores) -> None:
    async def main() -> None:
        async with make_stores() as stores:
            ids = [(await stores.jobs.create(spec(f"j{i}")))[0].job_id for i in range(5)]
            seen: list[str] = []
            token = ""
            pages = 0
            while True:
                page = await stores.jobs.list_jobs(page_size=2, page_token=token)
                seen += [job.job_id for job in page.jobs]
                pages += 1
                token = page.next_page_token
                if not token:
                    break
            assert seen == list(reversed(ids))
            assert pages == 3
            with pytest.raises(ConfigError, match="page_token"):
                await stores.jobs.list_jobs(page_token="garbage")

    run(main)


def test_life_cycle_transitions_and_terminal_states_are_final(make_stores) -> None:
    async def main() -> None:
        async with make_stores() as stores:
            job, _ = await stores.jobs.create(spec())
            with pytest.raises(IllegalTransitionError, match="QUEUED and cannot become RUNNING"):
                await stores.jobs.transition(job.job_id, R)
            job = await stores.jobs.transition(
                job.job_id, A, reason="lease", worker_id="w1", next_attempt=True
            )
            assert (job.state, job.attempt, job.worker_id, job.reason) == (A, 1, "w1", "lease")
            with pytest.raises(StaleAttemptError):
                await stores.jobs.transition(job.job_id, R, expect_attempt=2)
            await stores.jobs.transition(job.job_id, R, expect_attempt=1)
            # Worker lost: back to QUEUED, attempt kept.
            job = await stores.jobs.transition(job.job_id, Q, reason="lost", worker_id="")
            assert (job.state, job.attempt, job.worker_id) == (Q, 1, "")
            await stores.jobs.transition(job.job_id, A, worker_id="w2", next_attempt=True)
            await stores.jobs.transition(job.job_id, R)
            result = scheduler_pb2.JobResult(
                checkpoint_uri="file:///ckpt", final_metrics={"r": 1.0}
            )
            done = await stores.jobs.transition(job.job_id, S, reason="ok", result=result)
            assert done.checkpoint_uri == "file:///ckpt" and dict(done.final_metrics) == {"r": 1.0}
            for state in (Q, A, R, F, C):
                with pytest.raises(IllegalTransitionError, match="terminal states are final"):
                    await stores.jobs.transition(job.job_id, state)
            assert (await stores.jobs.get(job.job_id)).state == S

    run(main)


def test_concurrent_transitions_from_one_state_have_one_winner(make_stores) -> None:
    async def main() -> None:
        async with make_stores() as stores:
            job, _ = await stores.jobs.create(spec())
            await stores.jobs.transition(job.job_id, A, next_attempt=True)
            await stores.jobs.transition(job.job_id, R)
            outcomes = await asyncio.gather(
                stores.jobs.transition(job.job_id, S),
                stores.jobs.transition(job.job_id, F, reason="x"),
                stores.jobs.transition(job.job_id, C, reason="y"),
                return_exceptions=True,
            )
            assert sum(not isinstance(o, Exception) for o in outcomes) == 1
            assert sum(isinstance(o, IllegalTransitionError) for o in outcomes) == 2

    run(main)


def test_attempt_reports_are_kept_per_attempt(make_stores) -> None:
    async def main() -> None:
        async with make_stores() as stores:
            job, _ = await stores.jobs.create(spec())
            assert (await stores.jobs.report(job.job_id, 1)).result is None
            await stores.jobs.record_failure(job.job_id, 1, "out of memory")
            await stores.jobs.record_lost(job.job_id, 1, "worker w1 lost")
            await stores.jobs.record_step(job.job_id, 2, common_pb2.StepMetrics(step=7))
            await stores.jobs.record_result(
                job.job_id, 2, scheduler_pb2.JobResult(checkpoint_uri="file:///c")
            )
            first = await stores.jobs.report(job.job_id, 1)
            second = await stores.jobs.report(job.job_id, 2)
            assert first.failure_reason == "out of memory" and first.result is None
            assert first.lost_reason == "worker w1 lost"
            assert second.failure_reason == "" and second.result is not None
            assert second.lost_reason == ""
            assert second.result.checkpoint_uri == "file:///c"
            assert second.last_step is not None and second.last_step.step == 7

    run(main)


def test_a_session_keeps_its_opening_key_until_it_ends(make_stores) -> None:
    """The key prefix that opened a session is kept with the job from its creation (a repeated
    request does not replace it) until its last transition (revoked_sessions.py)."""

    async def main() -> None:
        async with make_stores() as stores:
            jobs = stores.jobs
            session, _ = await jobs.create(spec("s"), request_id="r1", opened_by="k1")
            await jobs.create(spec("s"), request_id="r1", opened_by="k2")  # the same job
            other, _ = await jobs.create(spec("rl"))
            assert await jobs.session_openers() == {session.job_id: "k1"}
            await jobs.transition(session.job_id, A, next_attempt=True)
            await jobs.transition(session.job_id, R)
            assert await jobs.session_openers() == {session.job_id: "k1"}
            await jobs.transition(session.job_id, C, reason="closed")
            await jobs.transition(other.job_id, C)
            assert await jobs.session_openers() == {}

    run(main)


# ---- JobQueue ---------------------------------------------------------------------------------


def test_queue_is_fifo_with_front_requeue_and_removal(make_stores) -> None:
    async def main() -> None:
        async with make_stores() as stores:
            q = stores.queue
            for job_id in ("a", "b", "c", "d"):
                await q.push(job_id)
            assert await q.remove("c") is True
            assert await q.remove("c") is False
            await q.push_front("d")  # a lost worker's job goes first, once
            assert await q.list_ids() == ["d", "a", "b"]
            assert [await q.pop() for _ in range(4)] == ["d", "a", "b", None]

    run(main)


# ---- EventLog ---------------------------------------------------------------------------------


def test_concurrent_appends_get_gapless_sequence_numbers(make_stores) -> None:
    async def main() -> None:
        async with make_stores() as stores:
            appended = await asyncio.gather(
                *[
                    stores.events.append(
                        "job-1", common_pb2.JobEvent(log=common_pb2.LogLine(message=str(i)))
                    )
                    for i in range(50)
                ]
            )
            assert sorted(e.seq for e in appended) == list(range(1, 51))
            assert all(e.job_id == "job-1" and e.time_unix_s > 0 for e in appended)
            replay = [e async for e in stores.events.read("job-1", 1, follow=False)]
            assert [e.seq for e in replay] == list(range(1, 51))
            assert await stores.events.last_seq("job-1") == 50
            assert await stores.events.last_seq("job-other") == 0

    run(main)


def test_read_replays_from_a_seq_then_follows_until_terminal(make_stores) -> None:
    async def main() -> None:
        async with make_stores() as stores:
            ev = stores.events
            await ev.append("j", state_change(Q, "submitted"))
            await ev.append("j", state_change(A))
            await ev.append("j", state_change(R))

            async def watch(from_seq: int) -> list[int]:
                return [e.seq async for e in ev.read("j", from_seq)]

            early = asyncio.create_task(watch(0))
            late = asyncio.create_task(watch(3))
            await asyncio.sleep(0.2)
            assert not early.done()  # still following live
            await ev.append("j", common_pb2.JobEvent(step=common_pb2.StepMetrics(step=1)))
            await ev.append("j", state_change(S, "done"))
            await ev.append("j", common_pb2.JobEvent(log=common_pb2.LogLine(message="after")))
            assert await asyncio.wait_for(early, 5) == [1, 2, 3, 4, 5]
            assert await asyncio.wait_for(late, 5) == [3, 4, 5]
            # A watcher attaching after the end replays the whole history and stops.
            assert await asyncio.wait_for(watch(1), 5) == [1, 2, 3, 4, 5]
            # Starting past the terminal event ends after what is left, without waiting.
            assert await asyncio.wait_for(watch(6), 5) == [6]
            assert await asyncio.wait_for(watch(9), 5) == []

    run(main)


def test_retention_trims_the_oldest_progress_events_and_keeps_every_state_change(
    redis_url: str,
) -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            ev = redis_stores(
                client, lease_ttl_s=10.0, server_secret=b"t" * 32, event_max_progress=3
            ).events
            await ev.append("j", state_change(Q, "submitted"))  # seq 1
            await ev.append("j", state_change(A))  # seq 2
            await ev.append("j", state_change(R, "running"))  # seq 3
            for step in range(1, 6):  # seqs 4..8
                await ev.append("j", common_pb2.JobEvent(step=common_pb2.StepMetrics(step=step)))
            await ev.append("j", common_pb2.JobEvent(log=common_pb2.LogLine(message="x")))  # 9
            await ev.append("j", state_change(S, "trainer finished"))  # seq 10

            kept = [e async for e in ev.read("j", 1)]
            # Every state change and the 3 newest progress events, with their original seqs:
            # the jump from 3 to 7 is where steps 1..3 were trimmed.
            assert [e.seq for e in kept] == [1, 2, 3, 7, 8, 9, 10]
            assert [e.state_change.state for e in kept if e.HasField("state_change")] == [
                Q,
                A,
                R,
                S,
            ]
            assert [e.step.step for e in kept if e.HasField("step")] == [4, 5]
            assert kept[-1].state_change.reason == "trainer finished"
            # A late watcher from a trimmed seq starts at the next kept event, ends at the end.
            assert [e.seq async for e in ev.read("j", 5)] == [7, 8, 9, 10]
            assert await ev.last_seq("j") == 10
            # State changes do not count against the limit: one more step trims one step.
            await ev.append("j", common_pb2.JobEvent(step=common_pb2.StepMetrics(step=6)))
            assert [e.seq async for e in ev.read("j", 1, follow=False)] == [1, 2, 3, 8, 9, 10, 11]
        finally:
            await client.aclose()

    run(main)


# ---- persistence ------------------------------------------------------------------------------


def test_jobs_survive_a_redis_restart(tmp_path) -> None:
    """RedisProcess keeps an append-only file: a restarted server on the same folder has it all."""
    from opentinker.services.launcher.redis_process import RedisProcess

    async def create(url: str) -> str:
        client = aioredis.Redis.from_url(url)
        try:
            stores = redis_stores(client, lease_ttl_s=10.0, server_secret=b"t" * 32)
            job, _ = await stores.jobs.create(spec("kept"), request_id="r1")
            await stores.events.append(job.job_id, state_change(Q, "submitted"))
            return job.job_id
        finally:
            await client.aclose()

    async def read(url: str, job_id: str) -> tuple[str, int]:
        client = aioredis.Redis.from_url(url)
        try:
            stores = redis_stores(client, lease_ttl_s=10.0, server_secret=b"t" * 32)
            return (await stores.jobs.get(job_id)).spec.name, await stores.events.last_seq(job_id)
        finally:
            await client.aclose()

    with RedisProcess(tmp_path / "data") as server:
        job_id = asyncio.run(create(server.url))
    with RedisProcess(tmp_path / "data") as server:
        assert asyncio.run(read(server.url, job_id)) == ("kept", 1)
