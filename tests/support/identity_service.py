"""A real scheduler for the whole test session, for the services that check credentials with
it (EnvHub asks its IdentityService). It keeps its identities in Redis database 15 of the
session's redis-server, so the per-test FLUSHDB of database 0 leaves them alone, and runs on an
event loop of its own in a background thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from identity_helpers import api_key, worker_token

from opentinker.services.scheduler.server import running_scheduler
from opentinker.services.scheduler.settings import SchedulerSettings

# Jobs that tests run without a scheduler of their own (trainer and rollout driven directly).
TEST_JOB_IDS = ("job-1", "job-proc", "job-9", "job-r")


@dataclass(frozen=True)
class Identities:
    """Where the identity service is and credentials made through it."""

    scheduler_address: str
    user_key: str  # user alice, tenant acme
    other_tenant_key: str  # user bob, tenant globex
    admin_key: str  # user root, tenant system, role admin
    worker_token: str
    job_tokens: dict[str, str]  # job id -> a job token of its attempt 1, tenant acme

    def job_token(self, job_id: str) -> str:
        return self.job_tokens[job_id]


@contextmanager
def session_identity_service(redis_server_url: str) -> Iterator[Identities]:
    url = redis_server_url.rsplit("/", 1)[0] + "/15"
    ready: list[Identities] = []
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def serve() -> None:
        settings = SchedulerSettings(redis_url=url, port=0)
        async with running_scheduler(settings, stop_grace_s=0.2) as running:
            identity = running.stores.identity
            ready.append(
                Identities(
                    scheduler_address=running.address,
                    user_key=await api_key(identity, tenant="acme", user="alice"),
                    other_tenant_key=await api_key(identity, tenant="globex", user="bob"),
                    admin_key=await api_key(identity, tenant="system", user="root", admin=True),
                    worker_token=await worker_token(identity),
                    job_tokens={
                        job_id: await identity.issue_job_token(
                            job_id, 1, tenant_id="acme", user_id="alice"
                        )
                        for job_id in TEST_JOB_IDS
                    },
                )
            )
            started.set()
            await stop.wait()

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(serve())
        finally:
            started.set()

    thread = threading.Thread(target=main, name="identity-scheduler", daemon=True)
    thread.start()
    started.wait(30)
    if not ready:
        raise RuntimeError("the session's identity scheduler did not start")
    try:
        yield ready[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
