"""For benchmarks that run EnvHub in-process: a real Redis and scheduler whose IdentityService
checks the benchmark's credentials, and an API key of a benchmark user."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from opentinker.services.launcher.redis_process import RedisProcess
from opentinker.services.scheduler.server import running_scheduler
from opentinker.services.scheduler.settings import SchedulerSettings


@dataclass(frozen=True)
class BenchIdentity:
    scheduler_address: str
    api_key: str


@asynccontextmanager
async def bench_identity() -> AsyncIterator[BenchIdentity]:
    with tempfile.TemporaryDirectory() as tmp, RedisProcess(Path(tmp)) as redis:
        settings = SchedulerSettings(redis_url=redis.url, port=0, log_level="WARNING")
        async with running_scheduler(settings, stop_grace_s=0.2) as running:
            identity = running.stores.identity
            await identity.create_tenant("bench")
            await identity.create_user("bench", "bench")
            key, _ = await identity.create_api_key("bench", label="benchmark")
            yield BenchIdentity(running.address, key)
