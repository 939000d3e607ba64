"""The job queue: job ids waiting for devices, first in first out.

A job whose worker was lost goes back to the front, so it resumes before newer jobs start.
Redis layout: one LIST ``<prefix>`` (default ``ot:queue``), head = next job.
"""

from __future__ import annotations

from typing import Protocol

import redis.asyncio as aioredis

from opentinker.services.scheduler.redis_text import as_text


class JobQueue(Protocol):
    async def push(self, job_id: str) -> None:
        """Append at the back (a job already queued moves there)."""

    async def push_front(self, job_id: str) -> None:
        """Put at the front (a job already queued moves there)."""

    async def ensure(self, job_id: str) -> bool:
        """Append at the back unless already queued (where it keeps its place); True when it
        was appended."""

    async def pop(self) -> str | None:
        """Take the next job id, or None when the queue is empty."""

    async def remove(self, job_id: str) -> bool:
        """Take this job out of the queue; False when it was not there."""

    async def list_ids(self) -> list[str]:
        """Every queued job id, next first."""


_PUSH = """
redis.call('LREM', KEYS[1], 0, ARGV[1])
if ARGV[2] == 'front' then redis.call('LPUSH', KEYS[1], ARGV[1])
else redis.call('RPUSH', KEYS[1], ARGV[1]) end
return 1
"""

_ENSURE = """
if redis.call('LPOS', KEYS[1], ARGV[1]) then return 0 end
redis.call('RPUSH', KEYS[1], ARGV[1])
return 1
"""


class RedisJobQueue:
    """JobQueue on one Redis LIST."""

    def __init__(self, client: aioredis.Redis, *, key: str = "ot:queue") -> None:
        self._r = client
        self.key = key
        self._push = client.register_script(_PUSH)
        self._ensure = client.register_script(_ENSURE)

    async def push(self, job_id: str) -> None:
        await self._push(keys=[self.key], args=[job_id, "back"])

    async def push_front(self, job_id: str) -> None:
        await self._push(keys=[self.key], args=[job_id, "front"])

    async def ensure(self, job_id: str) -> bool:
        return bool(await self._ensure(keys=[self.key], args=[job_id]))

    async def pop(self) -> str | None:
        raw = await self._r.lpop(self.key)
        return as_text(raw) if isinstance(raw, (bytes, str)) else None

    async def remove(self, job_id: str) -> bool:
        return bool(await self._r.lrem(self.key, 0, job_id))

    async def list_ids(self) -> list[str]:
        return [as_text(raw) for raw in await self._r.lrange(self.key, 0, -1)]
