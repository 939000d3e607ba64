"""Accounting: what each job and tenant used, written by the scheduler.

Device-seconds run from a lease's start to its release, summed over its devices (so two GPUs
for an hour are 7,200). Tokens and steps come from the trainer's step reports. Every amount is
added to the job, to the tenant's running total, and to the tenant's current budget period
(periods start at multiples of ``period_s`` since the epoch, so a day is a UTC day).

Redis layout (``prefix`` defaults to ``ot:usage``)::

    <prefix>:job:<job_id>                          HASH device_seconds, tokens_generated, ...
    <prefix>:tenant:<tenant_id>:total              HASH the same fields
    <prefix>:tenant:<tenant_id>:period:<start>     HASH the same fields, expiring after 2 periods
    <prefix>:once:<job_id>:<key>                   STRING an addition made once (a report sent
                                                   again is not counted again), for an hour
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
# How long an addition made ``once`` is remembered: far longer than a trainer resends a report
# (TrainerSettings.report_retry_s, 120 s by default).
ONCE_TTL_S = 3600

# KEYS: job, total, period[, once]. ARGV: the period's TTL, once's TTL, n, then n (field,
# amount) pairs for the job and the total, then the period's pairs. 0 when ``once`` was made.
_ADD = """
if KEYS[4] and not redis.call('SET', KEYS[4], '1', 'NX', 'EX', ARGV[2]) then return 0 end
local n = tonumber(ARGV[3])
for i = 4, 3 + 2 * n, 2 do
  redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
  redis.call('HINCRBYFLOAT', KEYS[2], ARGV[i], ARGV[i + 1])
end
for i = 4 + 2 * n, #ARGV, 2 do redis.call('HINCRBYFLOAT', KEYS[3], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[3], ARGV[1])
return 1
"""


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
        once: str = "",
    ) -> None:
        """Add ``usage`` to the job and the tenant's total, and ``in_period`` (None: all of
        ``usage``) to the tenant's current period: what was used before the period began
        counts to the totals only. ``once``: a key of this addition within the job; an
        addition with a key already added (for ONCE_TTL_S) is not made again."""

    async def job(self, job_id: str) -> Usage: ...
    async def tenant(self, tenant_id: str, *, period_s: float = 0.0) -> tuple[Usage, Usage]:
        """(this period's usage, the total)."""


class RedisUsageStore:
    def __init__(self, client: aioredis.Redis, *, prefix: str = "ot:usage") -> None:
        self._r = client
        self._prefix = prefix
        self._add = client.register_script(_ADD)

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
        once: str = "",
    ) -> None:
        amounts = usage.amounts()
        period_amounts = amounts if in_period is None else in_period.amounts()
        if not amounts and not period_amounts:
            return
        period_s = period_s or DEFAULT_PERIOD_S
        period = self._key(
            "tenant", tenant_id, "period", f"{period_start(time.time(), period_s):.0f}"
        )
        keys = [self._key("job", job_id), self._key("tenant", tenant_id, "total"), period]
        if once:
            keys.append(self._key("once", job_id, once))
        args: list[str | int] = [int(2 * period_s) + 60, ONCE_TTL_S, len(amounts)]
        for pairs in (amounts, period_amounts):
            for name, amount in pairs.items():
                args += [name, repr(amount)]
        await self._add(keys=keys, args=args)

    async def job(self, job_id: str) -> Usage:
        return Usage.from_hash(await self._r.hgetall(self._key("job", job_id)))

    async def tenant(self, tenant_id: str, *, period_s: float = 0.0) -> tuple[Usage, Usage]:
        start = period_start(time.time(), period_s)
        period = await self._r.hgetall(self._key("tenant", tenant_id, "period", f"{start:.0f}"))
        total = await self._r.hgetall(self._key("tenant", tenant_id, "total"))
        return Usage.from_hash(period), Usage.from_hash(total)
