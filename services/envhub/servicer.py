"""EnvHubService over gRPC: protobuf <-> registry / episode router, errors -> status codes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, Protocol

import grpc
import structlog

from opentinker.common.v1 import common_pb2
from opentinker.envhub.v1 import envhub_pb2, envhub_pb2_grpc, environment_pb2
from opentinker.errors import (
    EnvironmentError_,
    OpenTinkerError,
)
from opentinker.grpc_options import MAX_MESSAGE_BYTES
from opentinker.services.common.auth import JOBS, USERS, current_principal, rules_for
from opentinker.services.common.grpc_server import abort, abort_with
from opentinker.services.envhub.env_channels import EnvChannels
from opentinker.services.envhub.episodes import EpisodeRouter
from opentinker.services.envhub.image_limits import ImageLimits
from opentinker.services.envhub.registry import Instance, Registry, page
from opentinker.services.envhub.settings import EnvHubSettings

log = structlog.get_logger("opentinker.envhub")

# Replies to one EpisodeCalls message wait at most this long for the rest of its batch.
_REPLY_LINGER_S = 0.002
# One EpisodeReplies message holds at most this many bytes of replies: each reply is within
# EnvHub's limits, but a batch's replies together can pass gRPC's message limit, and a message
# gRPC refuses to send ends the whole stream.
_REPLIES_MAX_BYTES = MAX_MESSAGE_BYTES // 2


def _instance_pb(instance: Instance, *, with_address: bool) -> envhub_pb2.EnvironmentInstance:
    """An instance as the protocol shows it; its address only ``with_address`` (an admin's
    listing, or the registrant's own reply): to anyone else it is only a door to knock on.
    Never its env token."""
    return envhub_pb2.EnvironmentInstance(
        instance_id=instance.instance_id,
        env_name=instance.env_name,
        address=instance.address if with_address else "",
        capacity=instance.capacity,
        active_episodes=instance.active_episodes,
        registered_unix_s=instance.registered_unix_s,
        health=(
            envhub_pb2.INSTANCE_HEALTH_SERVING
            if instance.healthy
            else envhub_pb2.INSTANCE_HEALTH_NOT_SERVING
        ),
        tenant_id=instance.tenant_id,
        shared=instance.shared,
    )


# Who may call what: env servers register with their user's key; rollouts run episodes with
# their job token (or, run by hand, a user's key).
ACCESS_RULES = rules_for(
    envhub_pb2.DESCRIPTOR.services_by_name["EnvHubService"],
    {
        "RegisterEnvironment": USERS,
        "RenewRegistration": USERS,
        "DeregisterEnvironment": USERS,
        "ListEnvironments": USERS | JOBS,
        "RunEpisodes": USERS | JOBS,
    },
)


def _scope() -> str | None:
    """The tenant whose envs the caller may see (None for an admin: all)."""
    return current_principal().tenant_scope


class EnvHubServicer(envhub_pb2_grpc.EnvHubServiceServicer):
    def __init__(self, settings: EnvHubSettings, registry: Registry, channels: EnvChannels) -> None:
        self._settings = settings
        self._registry = registry
        self._channels = channels
        self._cleanups: set[asyncio.Task[None]] = set()

    async def RegisterEnvironment(self, request, context):  # noqa: N802
        caller = current_principal()
        if request.shared and not caller.is_admin:
            await abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"only an admin may register a shared env; {caller.describe()} is not one "
                "(register it unshared: it is then private to your tenant)",
                reason="SHARED_NEEDS_ADMIN",
            )
        try:
            instance = self._registry.register(
                request.env_name,
                request.address,
                request.capacity,
                env_token=request.env_token,
                tenant_id=caller.tenant_id,
                shared=request.shared,
            )
        except OpenTinkerError as err:
            await abort_with(context, err)
        log.info(
            "registered",
            env=instance.env_name,
            address=instance.address,
            tenant_id=instance.tenant_id,
            shared=instance.shared,
        )
        return envhub_pb2.RegisterEnvironmentResponse(
            instance=_instance_pb(instance, with_address=True),
            renew_interval_s=self._settings.renew_interval_s,
            ttl_s=self._settings.registration_ttl_s,
        )

    async def RenewRegistration(self, request, context):  # noqa: N802
        try:
            self._registry.renew(request.instance_id, tenant=_scope())
        except OpenTinkerError as err:
            await abort_with(context, err)
        return envhub_pb2.RenewRegistrationResponse()

    async def DeregisterEnvironment(self, request, context):  # noqa: N802
        self._registry.deregister(request.instance_id, tenant=_scope())
        return envhub_pb2.DeregisterEnvironmentResponse()

    async def ListEnvironments(self, request, context):  # noqa: N802
        admin = current_principal().is_admin
        try:
            instances, token = page(
                self._registry.instances(tenant=_scope()),
                page_size=request.page_size,
                page_token=request.page_token,
            )
        except OpenTinkerError as err:
            await abort_with(context, err)
        return envhub_pb2.ListEnvironmentsResponse(
            instances=[_instance_pb(i, with_address=admin) for i in instances],
            next_page_token=token,
        )

    async def RunEpisodes(self, request_iterator, context):  # noqa: N802
        first = await context.read()
        if first is grpc.aio.EOF or first.WhichOneof("payload") != "open":
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "the first RunEpisodes message must be 'open' (OpenEpisodes with env_name)",
            )
        caller = current_principal()
        if caller.kind == "job" and first.open.job_id != caller.job_id:
            await abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"open.job_id {first.open.job_id!r}: this job token is of job {caller.job_id}",
                reason="NOT_THIS_JOB",
            )
        router = EpisodeRouter(
            self._registry,
            self._channels,
            env_name=first.open.env_name,
            job_id=first.open.job_id,
            call_timeout_s=self._settings.env_call_timeout_s,
            capacity_wait_s=self._settings.capacity_wait_s,
            return_grace_s=self._settings.env_return_grace_s,
            max_observation_chars=self._settings.max_observation_chars,
            image_limits=ImageLimits(
                max_images=self._settings.max_observation_images,
                max_image_bytes=self._settings.max_image_bytes,
            ),
            tenant=caller.tenant_id,  # routing is by the caller's own tenant, admins too
        )
        try:
            spec = await router.open()
        except OpenTinkerError as err:
            await abort_with(context, err)
        replies = _Replies(context)
        await replies.send(opened=envhub_pb2.EpisodesOpened(spec=spec))
        in_flight: set[asyncio.Task[None]] = set()
        try:
            while (message := await context.read()) is not grpc.aio.EOF:
                handler = self._handler(router, replies, message, in_flight)
                if handler is not None:
                    _track(in_flight, asyncio.create_task(handler))
            await asyncio.gather(*in_flight)  # the client half-closed: finish what it asked
        finally:
            for task in in_flight:
                task.cancel()
            self._in_background(router.close_all())

    def _handler(
        self,
        router: EpisodeRouter,
        replies: _Replies,
        message: envhub_pb2.RunEpisodesRequest,
        in_flight: set[asyncio.Task[None]],
    ) -> Coroutine[Any, Any, None] | None:
        kind = message.WhichOneof("payload")
        if kind == "reset":
            return _reply_reset(router, replies, message.reset)
        if kind == "step":
            return _reply_step(router, replies, message.step)
        if kind == "close_episode":
            return router.close_episode(message.close_episode.episode_id)
        if kind == "calls":
            return _start_calls(router, replies, message.calls, in_flight)
        if kind == "heartbeat":
            return replies.send(heartbeat=common_pb2.Heartbeat(time_unix_s=time.time()))
        return None  # a repeated 'open' or an empty message: nothing to do

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)


def _track(in_flight: set[asyncio.Task[None]], task: asyncio.Task[None]) -> None:
    in_flight.add(task)
    task.add_done_callback(in_flight.discard)


class _ReplySink(Protocol):
    async def send(self, **payload: Any) -> None: ...


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


class _BatchReplies:
    """Gathers the replies to one EpisodeCalls message into EpisodeReplies messages.

    A reply waits until every call of the batch is answered, or at most ``linger_s`` after the
    oldest reply not yet sent: a slow episode holds the others back only that long. Replies
    that would take a message past ``max_bytes`` go out in the next one.
    """

    _FIELD = {"reset": "resets", "stepped": "stepped", "failed": "failed"}

    def __init__(
        self,
        replies: _Replies,
        *,
        expected: int,
        linger_s: float,
        max_bytes: int = _REPLIES_MAX_BYTES,
    ) -> None:
        self._replies = replies
        self._unanswered = expected
        self._linger_s = linger_s
        self._max_bytes = max_bytes
        self._buffer = envhub_pb2.EpisodeReplies()
        self._buffered_bytes = 0
        self._timer: asyncio.Task[None] | None = None

    async def send(self, **payload: Any) -> None:
        [(kind, reply)] = payload.items()
        size = reply.ByteSize()
        if self._buffered_bytes and self._buffered_bytes + size > self._max_bytes:
            await self.flush()  # too large together: what is gathered goes out first
        getattr(self._buffer, self._FIELD[kind]).append(reply)
        self._buffered_bytes += size
        self._unanswered -= 1
        if self._unanswered <= 0:
            await self.flush()
        elif self._timer is None:
            self._timer = asyncio.create_task(self._flush_later())

    async def flush(self) -> None:
        self.stop_timer()
        if self._buffer.ListFields():
            buffer, self._buffer = self._buffer, envhub_pb2.EpisodeReplies()
            self._buffered_bytes = 0
            await self._replies.send(replies=buffer)

    def stop_timer(self) -> None:
        if self._timer is not None and self._timer is not asyncio.current_task():
            self._timer.cancel()
        self._timer = None

    async def _flush_later(self) -> None:
        await asyncio.sleep(self._linger_s)
        self._timer = None
        await self.flush()


def _start_calls(
    router: EpisodeRouter,
    replies: _Replies,
    calls: envhub_pb2.EpisodeCalls,
    in_flight: set[asyncio.Task[None]],
) -> Coroutine[Any, Any, None]:
    """Start a batch of calls as if each came in its own message: resets, steps, then closes.

    The calls are started now, before any later message's, so one episode's calls keep their
    order across messages; each is tracked in ``in_flight`` (cancelled with the stream). The
    coroutine returned waits for them and sends the last replies.
    """
    batch = _BatchReplies(
        replies, expected=len(calls.resets) + len(calls.steps), linger_s=_REPLY_LINGER_S
    )
    work = [
        *(_reply_reset(router, batch, reset) for reset in calls.resets),
        *(_reply_step(router, batch, step) for step in calls.steps),
        *(router.close_episode(close.episode_id) for close in calls.closes),
    ]
    tasks = [asyncio.create_task(job) for job in work]
    for task in tasks:
        _track(in_flight, task)
    return _finish_calls(batch, tasks)


async def _finish_calls(batch: _BatchReplies, tasks: list[asyncio.Task[None]]) -> None:
    try:
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        await batch.flush()
    finally:
        batch.stop_timer()
        for task in tasks:
            task.cancel()
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome


async def _reply_reset(
    router: EpisodeRouter, replies: _ReplySink, request: environment_pb2.ResetRequest
) -> None:
    try:
        result = await router.reset(request)
    except EnvironmentError_ as err:
        await _reply_failed(replies, request.episode_id, err)
        return
    await replies.send(reset=envhub_pb2.EpisodeReset(episode_id=request.episode_id, result=result))


async def _reply_step(
    router: EpisodeRouter, replies: _ReplySink, request: environment_pb2.StepRequest
) -> None:
    try:
        result = await router.step(request)
    except EnvironmentError_ as err:
        await _reply_failed(replies, request.episode_id, err)
        return
    stepped = envhub_pb2.EpisodeStepped(episode_id=request.episode_id, result=result)
    await replies.send(stepped=stepped)


async def _reply_failed(replies: _ReplySink, episode_id: str, err: EnvironmentError_) -> None:
    failed = envhub_pb2.EpisodeFailed(episode_id=episode_id, reason=err.message, code=err.code)
    await replies.send(failed=failed)
