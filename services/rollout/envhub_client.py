"""Client of EnvHub's RunEpisodes stream: many concurrent episodes of one environment.

One bidirectional stream per batch of episodes. Requests carry their ``episode_id``; replies
come back in any order and resolve that episode's pending future. Every wait has a deadline,
so a dead EnvHub or environment becomes a clear error naming the environment, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Mapping

import grpc
import structlog

from opentinker.common.v1 import common_pb2
from opentinker.envhub.v1 import envhub_pb2, envhub_pb2_grpc, environment_pb2
from opentinker.errors import (
    EnvironmentError_,
    NotFoundError,
    OpenTinkerError,
    UnavailableError,
)
from opentinker.services.common.grpc_server import aio_channel

from .types import ResetResult, StepOutcome

log = structlog.get_logger("opentinker.rollout.envhub_client")

_CLOSE_GRACE_S = 5.0  # at most this long for EnvHub to finish a closed stream's work


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
    ) -> None:
        self.address = address
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
        self._channel = aio_channel(self.address)
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
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
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
            await self._write(envhub_pb2.RunEpisodesRequest(**{kind: payload}))
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
        """Tell EnvHub the episode is over (no reply is expected)."""
        if self._broken is None:
            await self._write(
                envhub_pb2.RunEpisodesRequest(
                    close_episode=environment_pb2.CloseEpisodeRequest(episode_id=episode_id)
                )
            )

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
            raise self._broken or self._stream_error(err) from None

    async def _read_replies(self) -> None:
        assert self._call is not None
        try:
            while True:
                reply = await self._call.read()
                if reply is grpc.aio.EOF:
                    self._fail_all(
                        UnavailableError(
                            f"EnvHub at {self.address} ended the episode stream of environment "
                            f"'{self.env_name}'"
                        )
                    )
                    return
                self._dispatch(reply)
        except grpc.aio.AioRpcError as err:
            self._fail_all(self._stream_error(err))

    def _dispatch(self, reply: envhub_pb2.RunEpisodesResponse) -> None:
        kind = reply.WhichOneof("payload")
        if kind == "opened":
            if self._opened is not None and not self._opened.done():
                self._opened.set_result(reply.opened.spec)
            return
        if kind == "heartbeat" or kind is None:
            return
        episode_id = getattr(reply, kind).episode_id
        waiting = self._pending.get(episode_id)
        if waiting is None or waiting[1].done():
            self._log.debug("late_reply_ignored", episode_id=episode_id, kind=kind)
            return
        expected, future = waiting
        if kind == "failed":
            future.set_exception(
                EnvironmentError_(
                    reply.failed.reason or f"environment '{self.env_name}' failed the episode",
                    code=reply.failed.code or "UNAVAILABLE",
                )
            )
        elif (kind, expected) in (("reset", "reset"), ("stepped", "step")):
            if not getattr(reply, kind).HasField("result"):
                future.set_exception(
                    EnvironmentError_(
                        f"EnvHub's {kind} reply of episode {episode_id} of environment "
                        f"'{self.env_name}' has no result (missing field)",
                        code="INTERNAL",
                    )
                )
                return
            future.set_result(getattr(reply, kind).result)
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

    def _stream_error(self, err: BaseException) -> OpenTinkerError:
        code = err.code() if isinstance(err, grpc.aio.AioRpcError) else None
        details = err.details() if isinstance(err, grpc.aio.AioRpcError) else repr(err)
        if code == grpc.StatusCode.NOT_FOUND:
            return NotFoundError(
                f"environment '{self.env_name}' is not registered with EnvHub at {self.address}: "
                f"{details}",
                code="NOT_FOUND",
            )
        code_name = code.name if code is not None else "UNAVAILABLE"
        return UnavailableError(
            f"episode stream of environment '{self.env_name}' via EnvHub at {self.address} "
            f"failed: {code_name}: {details}",
            code=code_name,
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


class EnvHubEpisode:
    """One episode on an ``EnvHubClient`` stream; implements the agent loop's ``EnvSession``."""

    def __init__(self, client: EnvHubClient, episode_id: str) -> None:
        self.client = client
        self.episode_id = episode_id

    async def reset(self, seed: int, options: Mapping[str, str]) -> ResetResult:
        reply = await self.client.request(
            self.episode_id,
            environment_pb2.ResetRequest(
                episode_id=self.episode_id, seed=seed, options=dict(options)
            ),
        )
        assert isinstance(reply, environment_pb2.ResetResponse)
        return ResetResult(system_prompt=reply.system_prompt, observation=reply.observation)

    async def step(self, action: str) -> StepOutcome:
        reply = await self.client.request(
            self.episode_id, environment_pb2.StepRequest(episode_id=self.episode_id, action=action)
        )
        assert isinstance(reply, environment_pb2.StepResponse)
        return StepOutcome(
            observation=reply.observation,
            reward=reply.reward,
            done=reply.done,
            info=dict(reply.info),
        )

    async def close(self) -> None:
        await self.client.close_episode(self.episode_id)
