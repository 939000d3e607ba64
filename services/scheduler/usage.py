"""Accounting: what each job and tenant used, written by the scheduler.

Device-seconds run from a lease's start to its release, summed over its devices (so two GPUs
for an hour are 7,200). Tokens and steps come from the trainer's step reports. Every amount is
added to the job, to the tenant's running total, and to the tenant's current budget period
(periods start at multiples of ``period_s`` since the epoch, so a day is a UTC day).

Redis layout (``prefix`` defaults to ``ot:usage``)::

    <prefix>:job:<job_id>                          HASH device_seconds, tokens_generated, ...
    <prefix>:tenant:<tenant_id>:total              HASH the same fields
    <prefix>:tenant:<tenant_id>:period:<start>     HASH the same fields, expiring after 2 periods
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Protocol

import redis.asyncio as aioredis

from opentinker.scheduler.v1 import scheduler_pb2

DEFAULT_PERIOD_S = 86_400.0


@dataclass(frozen=True)
class Usage:
    """Amounts used. device_seconds: seconds x devices; tokens and steps: counts."""

    device_seconds: float = 0.0
    tokens_generated: float = 0.0
    tokens_trained: float = 0.0
    steps: float = 0.0

    def to_proto(self) -> scheduler_pb2.Usage:
        return scheduler_pb2.Usage(**{f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_hash(cls, raw: Mapping[bytes | str, bytes | str]) -> Usage:
        # redis-py types a reply as bytes | str; ours are bytes (decode_responses=False).
        return cls(**{f.name: float(raw.get(f.name.encode(), 0) or 0) for f in fields(cls)})

    def amounts(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}


def period_start(now_unix_s: float, period_s: float) -> float:
    """The start of the budget period containing ``now_unix_s``."""
    period_s = period_s or DEFAULT_PERIOD_S
    return math.floor(now_unix_s / period_s) * period_s


class UsageStore(Protocol):
    async def add(
        self,
        job_id: str,
        tenant_id: str,
        usage: Usage,
        *,
        period_s: float = 0.0,
        in_period: Usage | None = None,
    ) -> None:
        """Add ``usage`` to the job and the tenant's total, and ``in_period`` (None: all of
        ``usage``) to the tenant's current period: what was used before the period began
        counts to the totals only."""

    async def job(self, job_id: str) -> Usage: ...
    async def tenant(self, tenant_id: str, *, period_s: float = 0.0) -> tuple[Usage, Usage]:
        """(this period's usage, the total)."""


class RedisUsageStore:
    def __init__(self, client: aioredis.Redis, *, prefix: str = "ot:usage") -> None:
        self._r = client
        self._prefix = prefix

    def _key(self, *parts: str) -> str:
        return ":".join((self._prefix, *parts))

    async def add(
        self,
        job_id: str,
        tenant_id: str,
        usage: Usage,
        *,
        period_s: float = 0.0,
        in_period: Usage | None = None,
    ) -> None:
        amounts = usage.amounts()
        period_amounts = amounts if in_period is None else in_period.amounts()
        if not amounts and not period_amounts:
            return
        period_s = period_s or DEFAULT_PERIOD_S
        period = self._key(
            "tenant", tenant_id, "period", f"{period_start(time.time(), period_s):.0f}"
        )
        async with self._r.pipeline(transaction=True) as pipe:
            for key in (self._key("job", job_id), self._key("tenant", tenant_id, "total")):
                for name, amount in amounts.items():
                    pipe.hincrbyfloat(key, name, amount)
            for name, amount in period_amounts.items():
                pipe.hincrbyfloat(period, name, amount)
            pipe.expire(period, int(2 * period_s) + 60)
            await pipe.execute()

    async def job(self, job_id: str) -> Usage:
        return Usage.from_hash(await self._r.hgetall(self._key("job", job_id)))

    async def tenant(self, tenant_id: str, *, period_s: float = 0.0) -> tuple[Usage, Usage]:
        start = period_start(time.time(), period_s)
        period = await self._r.hgetall(self._key("tenant", tenant_id, "period", f"{start:.0f}"))
        total = await self._r.hgetall(self._key("tenant", tenant_id, "total"))
        return Usage.from_hash(period), Usage.from_hash(total)
