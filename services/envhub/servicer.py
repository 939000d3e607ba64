"""EnvHubService over gRPC: protobuf <-> registry / episode router, errors -> status codes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, NoReturn

import grpc
import structlog

from opentinker.common.v1 import common_pb2
from opentinker.envhub.v1 import envhub_pb2, envhub_pb2_grpc, environment_pb2
from opentinker.errors import (
    EnvironmentError_,
    InvalidArgumentError,
    NotFoundError,
    OpenTinkerError,
    UnavailableError,
)
from opentinker.services.common.grpc_server import abort
from opentinker.services.envhub.episodes import EnvChannels, EpisodeRouter
from opentinker.services.envhub.registry import Instance, Registry, page
from opentinker.services.envhub.settings import EnvHubSettings

log = structlog.get_logger("opentinker.envhub")

_STATUS_OF: dict[type[OpenTinkerError], grpc.StatusCode] = {
    InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    NotFoundError: grpc.StatusCode.NOT_FOUND,
    UnavailableError: grpc.StatusCode.UNAVAILABLE,
}


async def _abort_with(context: grpc.aio.ServicerContext, err: OpenTinkerError) -> NoReturn:
    code = _STATUS_OF.get(type(err), grpc.StatusCode.INTERNAL)
    await abort(context, code, err.message, reason=err.reason)
    raise AssertionError("unreachable: abort raises")  # for type checkers


def _instance_pb(instance: Instance) -> envhub_pb2.EnvironmentInstance:
    return envhub_pb2.EnvironmentInstance(
        instance_id=instance.instance_id,
        env_name=instance.env_name,
        address=instance.address,
        capacity=instance.capacity,
        active_episodes=instance.active_episodes,
        registered_unix_s=instance.registered_unix_s,
    )


class EnvHubServicer(envhub_pb2_grpc.EnvHubServiceServicer):
    def __init__(self, settings: EnvHubSettings, registry: Registry, channels: EnvChannels) -> None:
        self._settings = settings
        self._registry = registry
        self._channels = channels
        self._cleanups: set[asyncio.Task[None]] = set()

    async def RegisterEnvironment(self, request, context):  # noqa: N802
        try:
            instance = self._registry.register(request.env_name, request.address, request.capacity)
        except OpenTinkerError as err:
            await _abort_with(context, err)
        log.info("registered", env=instance.env_name, address=instance.address)
        return envhub_pb2.RegisterEnvironmentResponse(
            instance=_instance_pb(instance),
            renew_interval_s=self._settings.renew_interval_s,
            ttl_s=self._settings.registration_ttl_s,
        )

    async def RenewRegistration(self, request, context):  # noqa: N802
        try:
            self._registry.renew(request.instance_id)
        except OpenTinkerError as err:
            await _abort_with(context, err)
        return envhub_pb2.RenewRegistrationResponse()

    async def DeregisterEnvironment(self, request, context):  # noqa: N802
        self._registry.deregister(request.instance_id)
        return envhub_pb2.DeregisterEnvironmentResponse()

    async def ListEnvironments(self, request, context):  # noqa: N802
        try:
            instances, token = page(
                self._registry.instances(),
                page_size=request.page_size,
                page_token=request.page_token,
            )
        except OpenTinkerError as err:
            await _abort_with(context, err)
        return envhub_pb2.ListEnvironmentsResponse(
            instances=[_instance_pb(i) for i in instances], next_page_token=token
        )

    async def RunEpisodes(self, request_iterator, context):  # noqa: N802
        first = await context.read()
        if first is grpc.aio.EOF or first.WhichOneof("payload") != "open":
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "the first RunEpisodes message must be 'open' (OpenEpisodes with env_name)",
            )
        router = EpisodeRouter(
            self._registry,
            self._channels,
            env_name=first.open.env_name,
            job_id=first.open.job_id,
            call_timeout_s=self._settings.env_call_timeout_s,
            max_observation_chars=self._settings.max_observation_chars,
        )
        try:
            spec = await router.open()
        except OpenTinkerError as err:
            await _abort_with(context, err)
        replies = _Replies(context)
        await replies.send(opened=envhub_pb2.EpisodesOpened(spec=spec))
        in_flight: set[asyncio.Task[None]] = set()
        try:
            while (message := await context.read()) is not grpc.aio.EOF:
                handler = self._handler(router, replies, message)
                if handler is not None:
                    task = asyncio.create_task(handler)
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
            await asyncio.gather(*in_flight)  # the client half-closed: finish what it asked
        finally:
            for task in in_flight:
                task.cancel()
            self._in_background(router.close_all())

    def _handler(
        self, router: EpisodeRouter, replies: _Replies, message: envhub_pb2.RunEpisodesRequest
    ) -> Coroutine[Any, Any, None] | None:
        kind = message.WhichOneof("payload")
        if kind == "reset":
            return _reply_reset(router, replies, message.reset)
        if kind == "step":
            return _reply_step(router, replies, message.step)
        if kind == "close_episode":
            return router.close_episode(message.close_episode.episode_id)
        if kind == "heartbeat":
            return replies.send(heartbeat=common_pb2.Heartbeat(time_unix_s=time.time()))
        return None  # a repeated 'open' or an empty message: nothing to do

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)


class _Replies:
    """Writes replies one at a time, numbering them from 1."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self._seq = 0
        self._lock = asyncio.Lock()

    async def send(self, **payload: Any) -> None:
        async with self._lock:
            self._seq += 1
            await self._context.write(envhub_pb2.RunEpisodesResponse(seq=self._seq, **payload))


async def _reply_reset(
    router: EpisodeRouter, replies: _Replies, request: environment_pb2.ResetRequest
) -> None:
    try:
        result = await router.reset(request)
    except EnvironmentError_ as err:
        await _reply_failed(replies, request.episode_id, err)
        return
    await replies.send(reset=envhub_pb2.EpisodeReset(episode_id=request.episode_id, result=result))


async def _reply_step(
    router: EpisodeRouter, replies: _Replies, request: environment_pb2.StepRequest
) -> None:
    try:
        result = await router.step(request)
    except EnvironmentError_ as err:
        await _reply_failed(replies, request.episode_id, err)
        return
    stepped = envhub_pb2.EpisodeStepped(episode_id=request.episode_id, result=result)
    await replies.send(stepped=stepped)


async def _reply_failed(replies: _Replies, episode_id: str, err: EnvironmentError_) -> None:
    failed = envhub_pb2.EpisodeFailed(episode_id=episode_id, reason=err.message, code=err.code)
    await replies.send(failed=failed)
