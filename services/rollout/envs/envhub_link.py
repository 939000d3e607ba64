"""Episodes through EnvHub that outlive EnvHub itself: reconnect when the stream breaks.

EnvHub keeps its registry and its episode routes in memory, so when it dies (or restarts)
every episode on the rollout's stream is lost with it: the client's waits fail with
``EnvLinkLostError`` and the agent loop starts those episodes over from Reset, with the same
seeds, on fresh ``LinkedEpisode`` sessions. Each fresh session first waits here for one shared
reconnect: a new RunEpisodes stream, tried again with backoff while EnvHub cannot be reached
(or, just restarted, does not know the environment yet because its env servers have not
registered again), for at most ``reconnect_s`` after the link was lost. Past that the link is
gone for good: every wait fails at once with an error naming EnvHub and its address. EnvHub's
own refusals (UNAUTHENTICATED, no live instance of the env) end the link at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping

import structlog

from opentinker.envhub.v1 import environment_pb2
from opentinker.errors import NotFoundError, OpenTinkerError, UnavailableError
from opentinker.services.common.tool_calls import ToolCalls
from opentinker.services.rollout.envs.envhub_client import EnvHubClient
from opentinker.services.rollout.envs.envhub_episode import EnvHubEpisode
from opentinker.services.rollout.envs.envhub_errors import ENV_UNAVAILABLE
from opentinker.services.rollout.types import ResetResult, StepOutcome

log = structlog.get_logger("opentinker.rollout.envhub_link")

_RETRY_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})  # EnvHub away, not refusing


class EnvHubUnreachableError(UnavailableError):
    """EnvHub stayed unreachable (or without the env) longer than the reconnect bound."""


class EnvHubLink:
    """A reconnecting link to EnvHub for one environment; use ``async with`` or open/close.

    connect: makes a fresh (unopened) ``EnvHubClient``. reconnect_s: how long (seconds) EnvHub
    may stay away before the link gives up; NOT_FOUND is waited out too (right after a restart
    EnvHub knows an env only once its servers have registered again).
    """

    def __init__(
        self,
        connect: Callable[[], EnvHubClient],
        *,
        address: str,
        env_name: str,
        reconnect_s: float,
        backoff_s: tuple[float, float] = (0.2, 2.0),
    ) -> None:
        self.address = address
        self.env_name = env_name
        self.reconnect_s = reconnect_s
        self.reconnects = 0  # how many times a lost stream was replaced
        self._make_client = connect
        self._backoff_s = backoff_s
        self._client: EnvHubClient | None = None
        self._connecting: asyncio.Task[EnvHubClient] | None = None
        self._gone: OpenTinkerError | None = None
        self._log = log.bind(env=env_name, envhub=address)

    async def __aenter__(self) -> EnvHubLink:
        try:
            await self.open()
        except BaseException:  # cancelled too: no reconnect task may outlive the link
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def gone(self) -> OpenTinkerError | None:
        """Why the link gave up (None while it is up or still reconnecting)."""
        return self._gone

    async def open(self) -> environment_pb2.EnvironmentSpec:
        """Open the first stream (EnvHub away is retried within the bound); returns the spec."""
        client = await self.client()
        assert client.spec is not None, "an opened client has its env's spec"
        return client.spec

    def session(self, episode_id: str) -> LinkedEpisode:
        """An ``EnvSession`` for one episode; it takes the link's stream at its reset."""
        return LinkedEpisode(self, episode_id)

    async def client(self) -> EnvHubClient:
        """A client with a healthy stream: the current one, or the next once reconnected.

        Raises the link's final error once it gave up (EnvHub away past the bound, or EnvHub
        refusing the stream: UNAUTHENTICATED, no live instance of the env, ...).
        """
        if self._gone is not None:
            raise self._gone
        if self._client is not None and self._client.broken is None:
            return self._client
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.create_task(self._connect(), name="envhub-reconnect")
        return await asyncio.shield(self._connecting)

    async def close(self) -> None:
        """Stop reconnecting and close the current stream (idempotent)."""
        if self._connecting is not None:
            self._connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError, OpenTinkerError):
                await self._connecting
            self._connecting = None
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _connect(self) -> EnvHubClient:
        """Open a new stream, retrying with backoff for at most ``reconnect_s``."""
        lost, self._client = self._client, None
        if lost is not None:
            await lost.close()
        started = time.monotonic()
        delay, max_delay = self._backoff_s
        attempt = 0
        while True:
            attempt += 1
            try:
                client = await self._open_client(started + self.reconnect_s - time.monotonic())
            except OpenTinkerError as err:
                left = started + self.reconnect_s - time.monotonic()
                if not self._retryable(err) or left <= 0:
                    self._gone = self._give_up(err, attempt, retryable=self._retryable(err))
                    raise self._gone from err
                self._log.info("envhub_reconnect_retrying", attempt=attempt, error=str(err))
                await asyncio.sleep(min(delay, left))
                delay = min(delay * 2, max_delay)
                continue
            self._client = client
            self.reconnects += lost is not None
            if lost is not None or attempt > 1:
                away_s = round(time.monotonic() - started, 3)
                self._log.warning(
                    "envhub_reconnected", attempts=attempt, away_s=away_s, stream_lost=bool(lost)
                )
            return client

    async def _open_client(self, left_s: float) -> EnvHubClient:
        """One try at a new stream, given at most ``left_s`` (and no less than a moment)."""
        client = self._make_client()
        try:
            await asyncio.wait_for(client.open(), max(left_s, 0.5))
        except TimeoutError:
            await client.close()
            raise UnavailableError(
                f"EnvHub at {self.address} did not open a stream in time", code="DEADLINE_EXCEEDED"
            ) from None
        except BaseException:
            await client.close()
            raise
        return client

    @staticmethod
    def _retryable(err: OpenTinkerError) -> bool:
        """EnvHub away (or not knowing the env yet), rather than refusing the stream."""
        if isinstance(err, NotFoundError):
            return True
        return err.code in _RETRY_CODES and err.reason != ENV_UNAVAILABLE

    def _give_up(self, err: OpenTinkerError, attempts: int, *, retryable: bool) -> OpenTinkerError:
        if not retryable:
            self._log.warning("envhub_refused_stream", error=str(err))
            return err
        self._log.error("envhub_unreachable", attempts=attempts, reconnect_s=self.reconnect_s)
        return EnvHubUnreachableError(
            f"EnvHub at {self.address} could not be reached (or did not serve environment "
            f"'{self.env_name}' again) within {self.reconnect_s:g} s ({attempts} tries; raise "
            f"OPENTINKER_ROLLOUT_ENVHUB_RECONNECT_S to wait longer); last error: {err}",
            code="UNAVAILABLE",
        )


class LinkedEpisode:
    """One episode through an ``EnvHubLink``; implements the agent loop's ``EnvSession``.

    Its reset takes the link's current stream (waiting for a reconnect when it is broken);
    its steps and close stay on that stream, where EnvHub knows the episode.
    """

    def __init__(self, link: EnvHubLink, episode_id: str) -> None:
        self.link = link
        self.episode_id = episode_id
        self._episode: EnvHubEpisode | None = None

    async def reset(self, seed: int, options: Mapping[str, str]) -> ResetResult:
        client = await self.link.client()
        self._episode = client.session(self.episode_id)
        return await self._episode.reset(seed, options)

    async def step(self, action: str, tool_calls: ToolCalls | None = None) -> StepOutcome:
        if self._episode is None:
            raise RuntimeError(f"episode {self.episode_id} stepped before its reset")
        return await self._episode.step(action, tool_calls)

    async def close(self) -> None:
        if self._episode is not None:
            await self._episode.close()
