"""Every job's event stream: state changes, step metrics, log lines and an inference job's
result rows, numbered 1, 2, 3…

Appending assigns the next ``seq`` atomically (one Lua script: INCR + XADD), so sequence numbers
are handed out without gaps even with concurrent writers. Readers replay from any ``seq`` and
then follow live events; a read ends once a terminal state change (SUCCEEDED, FAILED, CANCELLED)
was delivered, or at once when the reader starts past a job that has already ended.

Retention: a job keeps its newest ``max_progress`` progress events (step metrics and log lines);
appending one more deletes the oldest, in the same script. State changes and result rows (an
inference job's output: at most 10,000 rows of at most 16 KiB, see progress.py) are never
trimmed, so the whole life of a job, its terminal state and reason, and every result stay; the
final result and the last step live on the job record too (checkpoint_uri, final_metrics; the
attempt's last_step). A watcher that replays sees every state change, every row and the kept
progress events, in order, with their original ``seq``: a jump in ``seq`` marks trimmed events,
and ``from_seq`` may name a trimmed one (the replay starts at the next kept event).

Redis layout (``prefix`` defaults to ``ot:events``)::

    <prefix>:<job_id>        STREAM, entry id "<seq>-0", field "e" = serialized JobEvent (seq 0)
    <prefix>:<job_id>:seq    STRING last seq handed out
    <prefix>:<job_id>:done   STRING seq of the terminal state change, once there is one
    <prefix>:<job_id>:progress  LIST seqs of the kept progress events, oldest first
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import redis.asyncio as aioredis

from opentinker.common.v1 import common_pb2
from opentinker.services.scheduler.jobs.job_lifecycle import TERMINAL_STATES, JobState

_BATCH = 500


def state_change(state: JobState, reason: str = "") -> common_pb2.JobEvent:
    """An event announcing that the job entered ``state``."""
    return common_pb2.JobEvent(state_change=common_pb2.StateChange(state=state, reason=reason))


def is_progress(event: common_pb2.JobEvent) -> bool:
    """Step metrics and log lines: what the retention policy may trim."""
    return event.HasField("step") or event.HasField("log")


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
if ARGV[3] == '1' then
  redis.call('RPUSH', KEYS[4], seq)
  local keep = tonumber(ARGV[4])
  while redis.call('LLEN', KEYS[4]) > keep do
    redis.call('XDEL', KEYS[1], redis.call('LPOP', KEYS[4]) .. '-0')
  end
end
return seq
"""


class RedisEventLog:
    """EventLog on Redis streams. ``block_s`` bounds each wait so cancellation is prompt;
    ``max_progress`` is how many step/log events each job keeps (see the module docstring)."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str = "ot:events",
        block_s: float = 1.0,
        max_progress: int = 10_000,
    ) -> None:
        if max_progress < 1:
            raise ValueError(f"max_progress must be >= 1, got {max_progress}")
        self._r = client
        self._prefix = prefix
        self._max_progress = max_progress
        self._block_ms = max(1, round(block_s * 1000))
        self._append = client.register_script(_APPEND)

    def _keys(self, job_id: str) -> tuple[str, str, str, str]:
        stream = f"{self._prefix}:{job_id}"
        return stream, f"{stream}:seq", f"{stream}:done", f"{stream}:progress"

    async def append(self, job_id: str, event: common_pb2.JobEvent) -> common_pb2.JobEvent:
        stored = common_pb2.JobEvent()
        stored.CopyFrom(event)
        stored.seq = 0
        stored.job_id = job_id
        if not stored.time_unix_s:
            stored.time_unix_s = time.time()
        seq = await self._append(
            keys=list(self._keys(job_id)),
            args=[
                stored.SerializeToString(),
                "1" if is_terminal(stored) else "0",
                "1" if is_progress(stored) else "0",
                self._max_progress,
            ],
        )
        stored.seq = int(seq)
        return stored

    async def last_seq(self, job_id: str) -> int:
        raw = await self._r.get(self._keys(job_id)[1])
        return int(raw) if raw is not None else 0

    async def read(
        self, job_id: str, from_seq: int = 1, *, follow: bool = True
    ) -> AsyncIterator[common_pb2.JobEvent]:
        stream, _, done_key, _ = self._keys(job_id)
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
