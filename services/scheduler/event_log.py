"""Every job's event stream: state changes, step metrics and log lines, numbered 1, 2, 3…

Appending assigns the next ``seq`` atomically (one Lua script: INCR + XADD), so sequence numbers
have no gaps even with concurrent writers. Readers replay from any ``seq`` and then follow live
events; a read ends once a terminal state change (SUCCEEDED, FAILED, CANCELLED) was delivered,
or at once when the reader starts past a job that has already ended.

Redis layout (``prefix`` defaults to ``ot:events``)::

    <prefix>:<job_id>        STREAM, entry id "<seq>-0", field "e" = serialized JobEvent (seq 0)
    <prefix>:<job_id>:seq    STRING last seq handed out
    <prefix>:<job_id>:done   STRING seq of the terminal state change, once there is one
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import redis.asyncio as aioredis

from opentinker.common.v1 import common_pb2
from opentinker.services.scheduler.job_store import TERMINAL_STATES, JobState

_BATCH = 500


def state_change(state: JobState, reason: str = "") -> common_pb2.JobEvent:
    """An event announcing that the job entered ``state``."""
    return common_pb2.JobEvent(state_change=common_pb2.StateChange(state=state, reason=reason))


def is_terminal(event: common_pb2.JobEvent) -> bool:
    """True for the state change that ends a job."""
    return event.HasField("state_change") and event.state_change.state in TERMINAL_STATES


class EventLog(Protocol):
    async def append(self, job_id: str, event: common_pb2.JobEvent) -> common_pb2.JobEvent:
        """Store the event; returns it with seq, job_id and time_unix_s filled in."""

    def read(
        self, job_id: str, from_seq: int = 1, *, follow: bool = True
    ) -> AsyncIterator[common_pb2.JobEvent]:
        """Events with seq >= from_seq in order; with ``follow``, then wait for new ones until
        a terminal state change has been delivered."""

    async def last_seq(self, job_id: str) -> int:
        """The seq of the newest event (0 when there is none)."""


_APPEND = """
local seq = redis.call('INCR', KEYS[2])
redis.call('XADD', KEYS[1], seq .. '-0', 'e', ARGV[1])
if ARGV[2] == '1' and redis.call('EXISTS', KEYS[3]) == 0 then redis.call('SET', KEYS[3], seq) end
return seq
"""


class RedisEventLog:
    """EventLog on Redis streams. ``block_s`` bounds each wait so cancellation is prompt."""

    def __init__(
        self, client: aioredis.Redis, *, prefix: str = "ot:events", block_s: float = 1.0
    ) -> None:
        self._r = client
        self._prefix = prefix
        self._block_ms = max(1, round(block_s * 1000))
        self._append = client.register_script(_APPEND)

    def _keys(self, job_id: str) -> tuple[str, str, str]:
        stream = f"{self._prefix}:{job_id}"
        return stream, f"{stream}:seq", f"{stream}:done"

    async def append(self, job_id: str, event: common_pb2.JobEvent) -> common_pb2.JobEvent:
        stored = common_pb2.JobEvent()
        stored.CopyFrom(event)
        stored.seq = 0
        stored.job_id = job_id
        if not stored.time_unix_s:
            stored.time_unix_s = time.time()
        seq = await self._append(
            keys=list(self._keys(job_id)),
            args=[stored.SerializeToString(), "1" if is_terminal(stored) else "0"],
        )
        stored.seq = int(seq)
        return stored

    async def last_seq(self, job_id: str) -> int:
        raw = await self._r.get(self._keys(job_id)[1])
        return int(raw) if raw is not None else 0

    async def read(
        self, job_id: str, from_seq: int = 1, *, follow: bool = True
    ) -> AsyncIterator[common_pb2.JobEvent]:
        stream, _, done_key = self._keys(job_id)
        next_seq = max(from_seq, 1)
        while True:
            rows: Any = await self._r.xrange(stream, min=f"{next_seq}-0", max="+", count=_BATCH)
            for entry_id, fields in rows:
                event = _decode(entry_id, fields)
                next_seq = event.seq + 1
                yield event
                if follow and is_terminal(event):
                    return
            if len(rows) == _BATCH:
                continue
            if not follow:
                return
            done = await self._r.get(done_key)
            if done is not None and int(done) < next_seq:
                return  # the job ended before from_seq: nothing more will come
            # Wait (bounded) for anything newer than what was delivered, then re-read.
            await self._r.xread({stream: f"{next_seq - 1}-0"}, count=1, block=self._block_ms)


def _decode(entry_id: bytes | str, fields: dict[Any, bytes]) -> common_pb2.JobEvent:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    event = common_pb2.JobEvent.FromString(fields[b"e"])
    event.seq = int(text.split("-", 1)[0])
    return event
