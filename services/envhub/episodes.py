"""Route the episodes of one ``RunEpisodes`` stream to env instances and call them.

An episode is placed on the least-loaded instance with room when it is reset and stays there.
Calls of one episode run in the order they arrived; different episodes run concurrently.
Each stream's episode ids reach the env servers under a prefix of its own (``EpisodeRouter``
``_on_env``): env servers key their games by id, and two streams (two tenants on a shared env)
may name episodes alike. Every call has a deadline; any failure (dead instance, deadline, an
error from the game, a malformed reply: a non-finite reward, an observation longer than
``max_observation_chars``) ends the episode with an ``EnvironmentError_`` whose ``code`` is a
gRPC status name and whose message names the environment and the instance. Every call
presents the instance's env token (``opentinker-env-token`` metadata; env_auth.py), which its
server checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import structlog

from opentinker.env_auth import env_token_metadata
from opentinker.envhub.v1 import environment_pb2
from opentinker.errors import (
    EnvironmentError_,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from opentinker.services.envhub.env_channels import EnvChannels
from opentinker.services.envhub.image_limits import (
    DEFAULT_IMAGE_LIMITS,
    ImageLimits,
    image_problem,
)
from opentinker.services.envhub.registry import Instance, Registry, not_registered

log = structlog.get_logger("opentinker.envhub")
_Reply = TypeVar("_Reply")


# How often a Reset waiting for a slot looks again (EpisodeRouter._acquire).
CAPACITY_POLL_S = 0.05


def _presented(instance: Instance) -> tuple[tuple[str, str], ...]:
    """The metadata of every call to ``instance``: the env token its server registered with."""
    return env_token_metadata(instance.env_token)


@dataclass
class _Episode:
    instance: Instance | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class EpisodeRouter:
    """The episodes of one stream (one job, one environment)."""

    def __init__(
        self,
        registry: Registry,
        channels: EnvChannels,
        *,
        env_name: str,
        job_id: str,
        call_timeout_s: float,
        max_observation_chars: int,
        tenant: str,
        image_limits: ImageLimits = DEFAULT_IMAGE_LIMITS,
        capacity_wait_s: float = 0.0,
        return_grace_s: float = 0.0,
    ) -> None:
        """``tenant``: whose episodes these are; routed to its own env of that name, else to a
        shared one (Registry.routable). ``capacity_wait_s``: how long a Reset waits for a slot
        while every instance is at capacity (0 = fail at once). ``return_grace_s``: how long
        an open or a Reset waits for an env whose server died to register again."""
        self._registry = registry
        self._tenant = tenant
        self._channels = channels
        self.env_name = env_name
        self._timeout_s = call_timeout_s
        self._capacity_wait_s = capacity_wait_s
        self._return_grace_s = return_grace_s
        self._max_observation_chars = max_observation_chars
        self._image_limits = image_limits
        self._episodes: dict[str, _Episode] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._log = log.bind(env=env_name, job_id=job_id)
        # The prefix of this stream's episode ids on the env servers: a game is keyed by its
        # id there, and another stream (another tenant's, on a shared env) may use the same.
        self._stream = uuid.uuid4().hex[:16]

    def _on_env(self, episode_id: str) -> str:
        """``episode_id`` as the env servers see it: unique to this stream."""
        return f"{self._stream}/{episode_id}"

    async def open(self) -> environment_pb2.EnvironmentSpec:
        """The env's spec, from the first instance that answers (NotFound / Unavailable).

        Every instance is asked at once: asked in turn, each silent one (deadlocked, or
        unreachable without refusing) cost a whole call deadline before the next was tried."""
        instances = await self._routable_after_grace()
        asks = [asyncio.create_task(self._spec_of(instance)) for instance in instances]
        failures = []
        try:
            for answer in asyncio.as_completed(asks):
                spec, failure = await answer
                if spec is not None:
                    return spec
                failures.append(failure)
        finally:
            for task in asks:
                task.cancel()
            await asyncio.gather(*asks, return_exceptions=True)
        raise UnavailableError(
            f"no instance of environment '{self.env_name}' answered: {'; '.join(failures)}",
            code="UNAVAILABLE",
            reason="ENV_UNAVAILABLE",  # EnvHub's own answer: the rollout does not wait it out
        )

    async def _routable_after_grace(self) -> list[Instance]:
        """The env's instances; when none is left because its server died lately, wait up to
        ``return_grace_s`` for it to register again, then NOT_FOUND naming the dead server."""
        deadline = time.monotonic() + self._return_grace_s
        while True:
            instances = self._registry.routable(self.env_name, tenant=self._tenant)
            if instances:
                return instances
            gone = self._registry.departed(self.env_name, tenant=self._tenant)
            if gone is None or time.monotonic() >= deadline:
                raise not_registered(self._registry, self.env_name, self._tenant)
            await asyncio.sleep(CAPACITY_POLL_S)

    async def _spec_of(
        self, instance: Instance
    ) -> tuple[environment_pb2.EnvironmentSpec | None, str]:
        """The spec one instance gives, or (None, why it gave none)."""
        try:
            reply = await self._channels.stub(instance.address).GetEnvironmentSpec(
                environment_pb2.GetEnvironmentSpecRequest(),
                timeout=self._timeout_s,
                metadata=_presented(instance),
            )
        except grpc.aio.AioRpcError as err:
            return None, f"{instance.address}: {err.code().name}: {err.details()}"
        return reply.spec, ""

    async def reset(self, request: environment_pb2.ResetRequest) -> environment_pb2.ResetResponse:
        """Place (or re-place, on the same instance) an episode and reset it."""
        episode = self._episodes.setdefault(request.episode_id, _Episode())
        async with episode.lock:
            if episode.instance is None:
                try:
                    episode.instance = await self._acquire()
                except (NotFoundError, ResourceExhaustedError) as err:
                    self._forget(request.episode_id, episode)
                    code = "NOT_FOUND" if isinstance(err, NotFoundError) else "RESOURCE_EXHAUSTED"
                    raise EnvironmentError_(err.message, code=code) from err
            instance = episode.instance
            stub = self._channels.stub(instance.address)
            # Its own task, shielded: a Reset cut short by the stream's end still runs to its
            # end, so that the episode it opens on the env is closed after it (_close_after).
            routed = environment_pb2.ResetRequest()
            routed.CopyFrom(request)
            routed.episode_id = self._on_env(request.episode_id)
            call = asyncio.ensure_future(
                stub.Reset(routed, timeout=self._timeout_s, metadata=_presented(instance))
            )
            try:
                reply = await self._call(episode, request.episode_id, "Reset", asyncio.shield(call))
            except asyncio.CancelledError:
                self._close_after(call, episode, instance, request.episode_id)
                raise
            await self._check_observation(episode, request.episode_id, "Reset", reply)
            return reply

    async def _acquire(self) -> Instance:
        """A slot on an instance; while all are at capacity (episodes of other jobs sharing the
        env hold them), wait up to ``capacity_wait_s`` for one to be released."""
        deadline = time.monotonic() + self._capacity_wait_s
        grace = time.monotonic() + self._return_grace_s
        while True:
            try:
                return self._registry.acquire(self.env_name, tenant=self._tenant)
            except ResourceExhaustedError as err:
                if err.reason != "ENV_AT_CAPACITY" or time.monotonic() >= deadline:
                    raise
            except NotFoundError as err:  # its server died: it may come back (a restart)
                if err.reason != "ENV_SERVER_DIED" or time.monotonic() >= grace:
                    raise
            await asyncio.sleep(CAPACITY_POLL_S)

    async def step(self, request: environment_pb2.StepRequest) -> environment_pb2.StepResponse:
        # Wait behind earlier calls of this episode (a Reset sent just before, say).
        async with self._queued(request.episode_id).lock:
            episode = self._live(request.episode_id)
            instance = episode.instance
            assert instance is not None  # _live checked it
            routed = environment_pb2.StepRequest()
            routed.CopyFrom(request)
            routed.episode_id = self._on_env(request.episode_id)
            call = self._channels.stub(instance.address).Step(
                routed, timeout=self._timeout_s, metadata=_presented(instance)
            )
            reply = await self._call(episode, request.episode_id, "Step", call)
            if not math.isfinite(reply.reward):
                await self._fail_and_close(episode, request.episode_id)
                what = f"Step replied with a non-finite reward ({reply.reward})"
                raise self._failure(instance, request.episode_id, "INTERNAL", what)
            await self._check_observation(episode, request.episode_id, "Step", reply)
            return reply

    async def _check_observation(
        self,
        episode: _Episode,
        episode_id: str,
        method: str,
        reply: environment_pb2.ResetResponse | environment_pb2.StepResponse,
    ) -> None:
        """An observation over the limits (text or images) ends the episode (closed on its
        instance)."""
        chars = len(reply.observation)
        problem = image_problem(list(reply.observation_images), self._image_limits)
        if chars > self._max_observation_chars:
            problem = (
                f"an observation of {chars} characters, more than max_observation_chars "
                f"({self._max_observation_chars})"
            )
        if problem is None:
            return
        instance = episode.instance
        assert instance is not None
        await self._fail_and_close(episode, episode_id)
        raise self._failure(instance, episode_id, "INTERNAL", f"{method} replied with {problem}")

    async def close_episode(self, episode_id: str) -> None:
        """Free an episode on its instance (best effort); harmless for an unknown one."""
        episode = self._episodes.get(episode_id)
        if episode is not None:
            async with episode.lock:  # after the calls sent before it
                await self._fail_and_close(episode, episode_id)

    async def close_all(self) -> None:
        """Close every open episode of this stream on its instance (best effort)."""
        episodes = list(self._episodes.items())
        await asyncio.gather(*(self._fail_and_close(ep, eid) for eid, ep in episodes))

    @property
    def open_episodes(self) -> int:
        return len(self._episodes)

    def _queued(self, episode_id: str) -> _Episode:
        episode = self._episodes.get(episode_id)
        if episode is None:
            raise self._not_open(episode_id)
        return episode

    def _not_open(self, episode_id: str) -> EnvironmentError_:
        return EnvironmentError_(
            f"environment '{self.env_name}': episode '{episode_id}' is not open in this "
            "stream (never reset, closed, or failed); reset it first",
            code="NOT_FOUND",
        )

    def _live(self, episode_id: str) -> _Episode:
        episode = self._episodes.get(episode_id)
        if episode is None or episode.instance is None:
            raise self._not_open(episode_id)
        return episode

    async def _call(
        self, episode: _Episode, episode_id: str, method: str, call: Awaitable[_Reply]
    ) -> _Reply:
        """Await an env call; turn any RPC failure into an ended episode and a failure."""
        instance = episode.instance
        assert instance is not None
        try:
            return await call
        except grpc.aio.AioRpcError as err:
            code = err.code().name
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                what = f"{method} did not answer within {self._timeout_s:g} s"
            elif err.code() == grpc.StatusCode.UNAUTHENTICATED:
                # The server at that address refuses the token it registered with: not the
                # process that registered (restarted there, with a new token). The episode is
                # gone with that process; restart it (UNAVAILABLE) on a live registration.
                what = (
                    f"{method} failed: the server at {instance.address} refused the env token "
                    "this instance registered with (restarted, or another server on that "
                    f"port): {err.details()}"
                )
                code = "UNAVAILABLE"
                self._registry.deregister(instance.instance_id, why=what)
                self._log.warning("instance_refused_env_token_dropped", address=instance.address)
            else:
                what = f"{method} failed: {code}: {err.details()}"
            if err.code() == grpc.StatusCode.UNAVAILABLE and not instance.pinned:
                await self._drop_if_dead(instance, what)
            self._forget(episode_id, episode)
            if code != "UNAVAILABLE":  # free whatever it still holds
                self._in_background(self._close_on(instance, episode_id))
            raise self._failure(instance, episode_id, code, what) from err

    def _close_after(
        self,
        reset: asyncio.Future[environment_pb2.ResetResponse],
        episode: _Episode,
        instance: Instance,
        episode_id: str,
    ) -> None:
        """The stream ended while ``instance`` was resetting the episode: the env opens it when
        its Reset is done, after any close sent now (close_all's). Close it then, and only
        then give its slot back."""
        if self._episodes.get(episode_id) is episode:
            del self._episodes[episode_id]  # close_all leaves it to this

        async def close() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await reset
            await self._close_on(instance, episode_id)
            self._forget(episode_id, episode)

        self._in_background(close())

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _drop_if_dead(self, instance: Instance, last_error: str) -> None:
        """Deregister an instance that failed a call UNAVAILABLE, unless it still answers: a
        live server's game may report its own backend unavailable (UnavailableError), and
        dropping that server would fail every Reset until it registers again, then forget the
        episodes still on it (its slots). A dead one registers again if it comes back."""
        try:
            await self._channels.stub(instance.address).GetEnvironmentSpec(
                environment_pb2.GetEnvironmentSpecRequest(),
                timeout=min(self._timeout_s, 2.0),
                metadata=_presented(instance),
            )
            return
        except grpc.aio.AioRpcError:
            pass
        self._registry.deregister(instance.instance_id, why=f"last error: {last_error}")
        self._log.warning("instance_unavailable_dropped", address=instance.address)

    def _failure(
        self, instance: Instance, episode_id: str, code: str, what: str
    ) -> EnvironmentError_:
        message = (
            f"environment '{self.env_name}' instance {instance.address} "
            f"(id {instance.instance_id[:8]}), episode '{episode_id}': {what}"
        )
        self._log.warning("episode_failed", episode_id=episode_id, code=code, reason=message)
        return EnvironmentError_(message, code=code)

    def _forget(self, episode_id: str, episode: _Episode) -> None:
        """Drop the episode from this stream and give its slot back (once)."""
        if self._episodes.get(episode_id) is episode:
            del self._episodes[episode_id]
        if episode.instance is not None:
            self._registry.release(episode.instance.instance_id)
            episode.instance = None

    async def _fail_and_close(self, episode: _Episode, episode_id: str) -> None:
        """Close the episode on its instance, then give its slot back: a Reset waiting for
        that slot must not reach the env before the env has freed it."""
        instance = episode.instance
        if self._episodes.get(episode_id) is episode:  # a new Reset of this id starts afresh
            del self._episodes[episode_id]
        if instance is not None:
            await self._close_on(instance, episode_id)
        self._forget(episode_id, episode)

    async def _close_on(self, instance: Instance, episode_id: str) -> None:
        try:
            await self._channels.stub(instance.address).CloseEpisode(
                environment_pb2.CloseEpisodeRequest(episode_id=self._on_env(episode_id)),
                timeout=min(self._timeout_s, 2.0),
                metadata=_presented(instance),
            )
        except grpc.aio.AioRpcError as err:
            self._log.info("close_episode_failed", episode_id=episode_id, code=err.code().name)
