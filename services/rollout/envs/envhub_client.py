"""Client of EnvHub's RunEpisodes stream: many concurrent episodes of one environment.

One bidirectional stream per batch of episodes. Requests carry their ``episode_id``; the calls
issued in one event-loop tick go out as one ``EpisodeCalls`` message. Replies (gathered by
EnvHub into ``EpisodeReplies``) come back in any order and resolve that episode's pending
future. Every wait has a deadline, so a dead EnvHub or environment becomes a clear error naming
the environment, never a hang. When the stream itself breaks (EnvHub died or went away),
every wait fails with ``EnvLinkLostError``; ``envhub_link`` reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import grpc
import structlog

from opentinker.common.v1 import common_pb2
from opentinker.envhub.v1 import envhub_pb2, envhub_pb2_grpc, environment_pb2
from opentinker.errors import (
    EnvironmentError_,
    OpenTinkerError,
    UnavailableError,
)
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.rollout.agent.env_replies import EnvLinkLostError
from opentinker.services.rollout.envs.envhub_episode import EnvHubEpisode
from opentinker.services.rollout.envs.envhub_errors import stream_error

log = structlog.get_logger("opentinker.rollout.envhub_client")

_CLOSE_GRACE_S = 5.0  # at most this long for EnvHub to finish a closed stream's work
_CALL_RANK = {"reset": 0, "step": 1, "close": 2}  # EnvHub runs a batch's calls in this order


@dataclass
class _OutgoingCalls:
    """Calls waiting to go out in one message."""

    calls: envhub_pb2.EpisodeCalls = field(default_factory=envhub_pb2.EpisodeCalls)
    last_rank: dict[str, int] = field(default_factory=dict)  # per episode

    def takes(self, episode_id: str, kind: str) -> bool:
        """Whether a call can join without running before an earlier call of its episode."""
        return self.last_rank.get(episode_id, -1) < _CALL_RANK[kind]

    def add(self, episode_id: str, kind: str, payload: object) -> None:
        self.last_rank[episode_id] = _CALL_RANK[kind]
        getattr(self.calls, {"reset": "resets", "step": "steps", "close": "closes"}[kind]).append(
            payload
        )


class EnvHubClient:
    """One RunEpisodes stream to EnvHub for ``env_name``; use ``async with`` or open/close."""

    def __init__(
        self,
        address: str,
        *,
        job_id: str,
        env_name: str,
        timeout_s: float = 15.0,
        heartbeat_interval_s: float = 5.0,
        credential: str = "",
    ) -> None:
        """``credential``: a job token or API key; EnvHub routes to the envs its tenant may use."""
        self.address = address
        self._credential = credential
        self.job_id = job_id
        self.env_name = env_name
        self.timeout_s = timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.spec: environment_pb2.EnvironmentSpec | None = None
        self._channel: grpc.aio.Channel | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._seq = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self._opened: asyncio.Future[environment_pb2.EnvironmentSpec] | None = None
        self._pending: dict[str, tuple[str, asyncio.Future]] = {}
        self._broken: OpenTinkerError | None = None
        self._tasks: list[asyncio.Task] = []
        self._outbox: deque[_OutgoingCalls] = deque()  # the last one still takes calls
        self._sender: asyncio.Task[None] | None = None
        self._log = log.bind(env=env_name, envhub=address, job_id=job_id)

    async def __aenter__(self) -> EnvHubClient:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def open(self) -> environment_pb2.EnvironmentSpec:
        """Open the stream for the environment; returns its spec.

        Raises NotFoundError when EnvHub has no such environment, UnavailableError when EnvHub
        cannot be reached or does not answer within ``timeout_s``.
        """
        self._channel = aio_channel(self.address, credential=self._credential)
        self._call = envhub_pb2_grpc.EnvHubServiceStub(self._channel).RunEpisodes()
        self._opened = asyncio.get_running_loop().create_future()
        self._tasks = [
            asyncio.create_task(self._read_replies(), name=f"envhub-read-{self.env_name}")
        ]
        try:
            await self._write(
                envhub_pb2.RunEpisodesRequest(
                    open=envhub_pb2.OpenEpisodes(job_id=self.job_id, env_name=self.env_name)
                )
            )
            self.spec = await asyncio.wait_for(asyncio.shield(self._opened), self.timeout_s)
        except TimeoutError:
            await self.close()
            raise UnavailableError(
                f"EnvHub at {self.address} did not open episodes of environment "
                f"'{self.env_name}' within {self.timeout_s:g} s",
                code="DEADLINE_EXCEEDED",
            ) from None
        except OpenTinkerError:
            await self.close()
            raise
        if self.heartbeat_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._send_heartbeats()))
        self._log.debug("episodes_opened")
        return self.spec

    @property
    def broken(self) -> OpenTinkerError | None:
        """Why the stream is unusable (None while it is healthy)."""
        return self._broken

    def session(self, episode_id: str) -> EnvHubEpisode:
        """An ``EnvSession`` for one episode on this stream."""
        return EnvHubEpisode(self, episode_id)

    async def close(self) -> None:
        """End the stream and fail whatever still waits (idempotent).

        An open, healthy stream is half-closed first and EnvHub gets a few seconds to finish
        what it was sent (closing episodes on their instances) and end the stream itself;
        cancelling at once could cut those closes short and leave episodes on env servers.
        """
        if self.spec is not None and self._broken is None and self._tasks:
            await self._half_close(grace_s=min(self.timeout_s, _CLOSE_GRACE_S))
        self._fail_all(
            UnavailableError(f"the episode stream of environment '{self.env_name}' was closed")
        )
        tasks = [*self._tasks, *([self._sender] if self._sender is not None else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks, self._sender = [], None
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def _half_close(self, *, grace_s: float) -> None:
        reader, *others = self._tasks
        for task in others:  # heartbeats: nothing may be written after done_writing
            task.cancel()
        call = self._call
        assert call is not None
        try:
            if self._sender is not None:  # calls already issued go out first
                await asyncio.wait_for(asyncio.shield(self._sender), grace_s)
            async with self._write_lock:
                await asyncio.wait_for(call.done_writing(), grace_s)
            await asyncio.wait_for(asyncio.shield(reader), grace_s)
        except (grpc.RpcError, asyncio.InvalidStateError, TimeoutError) as err:
            self._log.info("episode_stream_close_cut_short", error=repr(err))

    async def request(
        self, episode_id: str, payload: environment_pb2.ResetRequest | environment_pb2.StepRequest
    ) -> environment_pb2.ResetResponse | environment_pb2.StepResponse:
        """Send a Reset or Step of one episode and wait (at most ``timeout_s``) for its reply."""
        kind = "reset" if isinstance(payload, environment_pb2.ResetRequest) else "step"
        if self._broken is not None:
            raise self._broken
        if episode_id in self._pending:
            raise RuntimeError(f"episode {episode_id} already waits for a reply")
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[episode_id] = (kind, future)
        try:
            # Not waiting for the write: a stream that cannot be written fails every pending
            # reply (``_fail_all``), this one included.
            self._queue(episode_id, kind, payload)
            return await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            raise UnavailableError(
                f"environment '{self.env_name}' did not answer {kind} of episode {episode_id} "
                f"within {self.timeout_s:g} s (via EnvHub at {self.address})",
                code="DEADLINE_EXCEEDED",
            ) from None
        finally:
            self._pending.pop(episode_id, None)

    async def close_episode(self, episode_id: str) -> None:
        """Tell EnvHub the episode is over. No reply is expected, so the close is only queued
        for the next message (written right after, in order; ``close`` flushes what is left):
        a batch's episodes end without waiting for their closes to be written."""
        if self._broken is None and self._call is not None:
            close = environment_pb2.CloseEpisodeRequest(episode_id=episode_id)
            self._queue(episode_id, "close", close)

    def _queue(self, episode_id: str, kind: str, payload: object) -> None:
        """Add a call to the outbox; the sender writes every call queued in this tick as one
        EpisodeCalls message (and the next ones in order)."""
        if self._call is None:
            raise self._broken or UnavailableError(
                f"no open stream for environment '{self.env_name}'"
            )
        if not self._outbox or not self._outbox[-1].takes(episode_id, kind):
            self._outbox.append(_OutgoingCalls())
        batch = self._outbox[-1]
        batch.add(episode_id, kind, payload)
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_outbox(), name="envhub-send")

    async def _send_outbox(self) -> None:
        """Write queued batches in order; calls issued in the same tick share one message.
        A failed write ends the stream (``_write``: every pending reply fails with it)."""
        await asyncio.sleep(0)  # let every task woken in this tick add its call
        while self._outbox:
            batch = self._outbox.popleft()
            try:
                await self._write(envhub_pb2.RunEpisodesRequest(calls=batch.calls))
            except OpenTinkerError:
                self._outbox.clear()
                return

    async def _write(self, message: envhub_pb2.RunEpisodesRequest) -> None:
        message.seq = next(self._seq)
        call = self._call
        if call is None:
            raise self._broken or UnavailableError(
                f"no open stream for environment '{self.env_name}'"
            )
        try:
            async with self._write_lock:
                await asyncio.wait_for(call.write(message), self.timeout_s)
        except (grpc.RpcError, asyncio.InvalidStateError, TimeoutError) as err:
            error = stream_error(err, env_name=self.env_name, address=self.address)
            self._fail_all(error)  # a stream that cannot be written is lost
            raise self._broken or error from None

    async def _read_replies(self) -> None:
        assert self._call is not None
        try:
            while True:
                reply = await self._call.read()
                if reply is grpc.aio.EOF:
                    self._fail_all(
                        EnvLinkLostError(
                            f"EnvHub at {self.address} ended the episode stream of environment "
                            f"'{self.env_name}'",
                            code="UNAVAILABLE",
                        )
                    )
                    return
                if reply is None:  # gRPC logs bytes that do not parse and hands on None
                    raise ValueError("it does not parse as RunEpisodesResponse")
                self._dispatch(reply)
        except grpc.aio.AioRpcError as err:
            self._fail_all(stream_error(err, env_name=self.env_name, address=self.address))
        except Exception as err:  # a reader that died silently left every wait to its deadline
            self._log.warning("episode_stream_unreadable", error=repr(err))
            self._fail_all(
                EnvLinkLostError(
                    f"EnvHub at {self.address} sent a reply the rollout cannot read on the "
                    f"episode stream of environment '{self.env_name}': "
                    f"{type(err).__name__}: {err}",
                    code="UNAVAILABLE",
                )
            )

    def _dispatch(self, reply: envhub_pb2.RunEpisodesResponse) -> None:
        kind = reply.WhichOneof("payload")
        if kind == "opened":
            if self._opened is not None and not self._opened.done():
                self._opened.set_result(reply.opened.spec)
            return
        if kind == "heartbeat" or kind is None:
            return
        if kind == "replies":
            for reset in reply.replies.resets:
                self._resolve("reset", reset)
            for stepped in reply.replies.stepped:
                self._resolve("stepped", stepped)
            for failed in reply.replies.failed:
                self._resolve("failed", failed)
            return
        self._resolve(kind, getattr(reply, kind))

    def _resolve(
        self,
        kind: str,
        body: envhub_pb2.EpisodeReset | envhub_pb2.EpisodeStepped | envhub_pb2.EpisodeFailed,
    ) -> None:
        """Settle the future of the episode a reply names."""
        episode_id = body.episode_id
        waiting = self._pending.get(episode_id)
        if waiting is None or waiting[1].done():
            self._log.debug("late_reply_ignored", episode_id=episode_id, kind=kind)
            return
        expected, future = waiting
        if isinstance(body, envhub_pb2.EpisodeFailed):
            future.set_exception(
                EnvironmentError_(
                    body.reason or f"environment '{self.env_name}' failed the episode",
                    code=body.code or "UNAVAILABLE",
                )
            )
        elif (kind, expected) in (("reset", "reset"), ("stepped", "step")):
            if not body.HasField("result"):
                future.set_exception(
                    EnvironmentError_(
                        f"EnvHub's {kind} reply of episode {episode_id} of environment "
                        f"'{self.env_name}' has no result (missing field)",
                        code="INTERNAL",
                    )
                )
                return
            future.set_result(body.result)
        else:
            future.set_exception(
                EnvironmentError_(
                    f"EnvHub answered {expected} of episode {episode_id} of environment "
                    f"'{self.env_name}' with {kind!r}",
                    code="INTERNAL",
                )
            )

    async def _send_heartbeats(self) -> None:
        while self._broken is None:
            await asyncio.sleep(self.heartbeat_interval_s)
            with contextlib.suppress(OpenTinkerError):
                await self._write(
                    envhub_pb2.RunEpisodesRequest(
                        heartbeat=common_pb2.Heartbeat(time_unix_s=time.time())
                    )
                )

    def _fail_all(self, error: OpenTinkerError) -> None:
        if self._broken is None:
            self._broken = error
        if self._opened is not None and not self._opened.done():
            self._opened.set_exception(self._broken)
            self._opened.exception()  # retrieved: no "never retrieved" warning if unawaited
        for _, future in self._pending.values():
            if not future.done():
                future.set_exception(self._broken)
        self._outbox.clear()
