"""Serve an ``AbstractGame`` as an ``EnvironmentService`` gRPC server, optionally registered
with EnvHub.

    serve(MyGame, name="my-game", envhub_address="localhost:50052")   # blocks until Ctrl-C

Episodes: one game instance per ``episode_id``, built by ``game_factory`` on ``Reset``.
- ``Reset`` of an id that is still live replaces that episode (the old game is closed), so a
  retried ``Reset`` never fails.
- ``Step`` of an unknown (never reset, closed, reaped or failed) episode is NOT_FOUND; a step
  after ``done`` is FAILED_PRECONDITION.
- An exception inside the game, or a malformed ``StepResult`` (non-finite reward, non-str
  observation), fails the RPC with INTERNAL naming the environment and the exception, and drops
  the episode. Bad reset options (``ValueError``/``TypeError`` from ``reset``) are
  INVALID_ARGUMENT.
- Episodes idle longer than ``idle_timeout_s`` are reaped; ``capacity`` live episodes at most
  (RESOURCE_EXHAUSTED beyond; 0 = unlimited).
- Every RPC runs on its own thread of a pool, so one slow ``step`` never stalls other episodes.

With ``envhub_address`` set, the server registers itself, renews on the interval EnvHub
returns (registering again when EnvHub answers NOT_FOUND, e.g. after an EnvHub restart), and
deregisters when stopped. Nothing here imports torch or the server extras.
"""

from __future__ import annotations

import math
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from opentinker.envhub.v1 import envhub_pb2, envhub_pb2_grpc, environment_pb2, environment_pb2_grpc
from opentinker.errors import (
    REASON_METADATA_KEY,
    EnvironmentError_,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    OpenTinkerError,
    ResourceExhaustedError,
)
from opentinker.game import AbstractGame, StepResult, first_user_message

GameFactory = Callable[[], AbstractGame]
_T = TypeVar("_T")

ENV_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]+$")
SERVICE_NAME = environment_pb2.DESCRIPTOR.services_by_name["EnvironmentService"].full_name
# The same limits as the services (opentinker.services.common.grpc_server); repeated here
# because the SDK must not import the server extras.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
]
_ENVHUB_CALL_TIMEOUT_S = 5.0

log = structlog.get_logger("opentinker.env_server")


@dataclass
class _Episode:
    game: AbstractGame
    last_used_s: float
    done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class EpisodeTable:
    """The live episodes of one environment: builds, steps, validates and frees games.

    Knows nothing of gRPC; raises the typed errors of ``opentinker.errors``. Thread-safe.
    """

    def __init__(
        self, game_factory: GameFactory, *, env_name: str, capacity: int, idle_timeout_s: float
    ) -> None:
        self._factory = game_factory
        self.env_name = env_name
        self._capacity = capacity
        self.idle_timeout_s = idle_timeout_s
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._episodes)

    def reset(self, episode_id: str, seed: int, options: dict[str, str]) -> tuple[str, str]:
        """Start (or restart) an episode; returns (system_prompt, first user message)."""
        if not episode_id:
            raise InvalidArgumentError("episode_id is empty; name every episode", reason="NO_ID")
        if "seed" in options:
            raise InvalidArgumentError(
                f"env option 'seed' is reserved in environment '{self.env_name}'; "
                "set the job's seed instead",
                reason="BAD_OPTIONS",
            )
        self.close(episode_id)  # a repeated Reset replaces the episode
        with self._lock:
            if 0 < self._capacity <= len(self._episodes):
                raise ResourceExhaustedError(
                    f"environment '{self.env_name}' already runs {self._capacity} episodes "
                    "(its capacity); close finished episodes or start another instance",
                    reason="AT_CAPACITY",
                )
        game = self._call("build a game", self._factory)
        try:
            observation = game.reset(seed=seed, **options)
        except (ValueError, TypeError) as exc:
            _close_quietly(game)
            raise InvalidArgumentError(
                f"environment '{self.env_name}' rejected the reset (seed={seed}, "
                f"options={options}): {type(exc).__name__}: {exc}",
                reason="BAD_OPTIONS",
            ) from exc
        except Exception as exc:
            _close_quietly(game)
            raise self._game_error("reset", exc) from exc
        try:
            system_prompt = self._call("get_system_prompt", game.get_system_prompt)
            intro = self._call("get_initial_user_message", game.get_initial_user_message)
            for what, value in (
                ("reset observation", observation),
                ("system prompt", system_prompt),
                ("initial user message", intro),
            ):
                if not isinstance(value, str):
                    raise self._bad_reply(f"its {what} is {type(value).__name__}, not str")
        except Exception:
            _close_quietly(game)
            raise
        with self._lock:
            replaced = self._episodes.get(episode_id)
            self._episodes[episode_id] = _Episode(game=game, last_used_s=time.monotonic())
        if replaced is not None:  # a concurrent Reset of the same id got there first
            _close_quietly(replaced.game)
        return system_prompt, first_user_message(intro, observation)

    def step(self, episode_id: str, action: str) -> StepResult:
        """Apply an action; a game failure or malformed result drops the episode."""
        episode = self._get(episode_id)
        with episode.lock:
            if episode.done:
                raise FailedPreconditionError(
                    f"episode '{episode_id}' of environment '{self.env_name}' is already done; "
                    "reset a new episode",
                    reason="EPISODE_DONE",
                )
            try:
                result = self._validated(self._call("step", lambda: episode.game.step(action)))
            except Exception:
                self._drop(episode_id, episode)
                raise
            episode.done = result.done
            episode.last_used_s = time.monotonic()
            return result

    def close(self, episode_id: str) -> None:
        """Free an episode; harmless for an unknown one."""
        with self._lock:
            episode = self._episodes.pop(episode_id, None)
        if episode is not None:
            _close_quietly(episode.game)

    def _drop(self, episode_id: str, episode: _Episode) -> None:
        with self._lock:
            if self._episodes.get(episode_id) is episode:
                del self._episodes[episode_id]
        _close_quietly(episode.game)

    def close_all(self) -> None:
        with self._lock:
            episodes, self._episodes = list(self._episodes.values()), {}
        for episode in episodes:
            _close_quietly(episode.game)

    def reap_idle(self) -> list[str]:
        """Close episodes unused for longer than ``idle_timeout_s``; returns their ids."""
        cutoff = time.monotonic() - self.idle_timeout_s
        with self._lock:
            idle = [eid for eid, ep in self._episodes.items() if ep.last_used_s < cutoff]
        for episode_id in idle:
            self.close(episode_id)
        return idle

    def _get(self, episode_id: str) -> _Episode:
        with self._lock:
            episode = self._episodes.get(episode_id)
        if episode is None:
            raise NotFoundError(
                f"environment '{self.env_name}' has no episode '{episode_id}' (never reset, "
                "closed, idle longer than "
                f"{self.idle_timeout_s:g} s, or failed); reset it first",
                reason="EPISODE_NOT_FOUND",
            )
        episode.last_used_s = time.monotonic()
        return episode

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except Exception as exc:
            raise self._game_error(what, exc) from exc

    def _game_error(self, what: str, exc: BaseException) -> EnvironmentError_:
        return EnvironmentError_(
            f"environment '{self.env_name}' raised in {what}: {type(exc).__name__}: {exc}",
            reason="GAME_RAISED",
        )

    def _bad_reply(self, problem: str) -> EnvironmentError_:
        return EnvironmentError_(
            f"environment '{self.env_name}' replied badly: {problem}", reason="BAD_REPLY"
        )

    def _validated(self, result: object) -> StepResult:
        if not isinstance(result, StepResult):
            raise self._bad_reply(f"step returned {type(result).__name__}, not StepResult")
        if not isinstance(result.observation, str):
            raise self._bad_reply(
                f"step observation is {type(result.observation).__name__}, not str"
            )
        if isinstance(result.reward, bool) or not isinstance(result.reward, (int, float)):
            raise self._bad_reply(f"step reward is {type(result.reward).__name__}, not a number")
        if not math.isfinite(result.reward):
            raise self._bad_reply(f"step reward is non-finite ({result.reward})")
        if not isinstance(result.done, bool):
            raise self._bad_reply(f"step done is {type(result.done).__name__}, not bool")
        if not isinstance(result.info, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in result.info.items()
        ):
            raise self._bad_reply("step info must be a dict of str to str")
        return result


def _close_quietly(game: AbstractGame) -> None:
    try:
        game.close()
    except Exception:
        log.warning("game_close_failed", game=type(game).__name__, exc_info=True)


_STATUS_OF: dict[type[OpenTinkerError], grpc.StatusCode] = {
    NotFoundError: grpc.StatusCode.NOT_FOUND,
    InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailedPreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    EnvironmentError_: grpc.StatusCode.INTERNAL,
}


def _abort(context: grpc.ServicerContext, err: OpenTinkerError) -> NoReturn:
    if err.reason:
        context.set_trailing_metadata(((REASON_METADATA_KEY, err.reason),))
    context.abort(_STATUS_OF.get(type(err), grpc.StatusCode.INTERNAL), err.message)
    raise AssertionError("unreachable: context.abort raises")  # for type checkers


class _EnvironmentServicer(environment_pb2_grpc.EnvironmentServiceServicer):
    """Protobuf <-> EpisodeTable; typed errors -> status codes."""

    def __init__(self, table: EpisodeTable, spec: environment_pb2.EnvironmentSpec) -> None:
        self._table = table
        self._spec = spec

    def GetEnvironmentSpec(self, request, context):  # noqa: N802
        return environment_pb2.GetEnvironmentSpecResponse(spec=self._spec)

    def Reset(self, request, context):  # noqa: N802
        try:
            system_prompt, observation = self._table.reset(
                request.episode_id, request.seed, dict(request.options)
            )
        except OpenTinkerError as err:
            log.warning("reset_failed", env=self._table.env_name, error=err.message)
            _abort(context, err)
        return environment_pb2.ResetResponse(system_prompt=system_prompt, observation=observation)

    def Step(self, request, context):  # noqa: N802
        try:
            result = self._table.step(request.episode_id, request.action)
        except OpenTinkerError as err:
            log.warning("step_failed", env=self._table.env_name, error=err.message)
            _abort(context, err)
        return environment_pb2.StepResponse(
            observation=result.observation,
            reward=float(result.reward),
            done=result.done,
            info=result.info,
        )

    def CloseEpisode(self, request, context):  # noqa: N802
        self._table.close(request.episode_id)
        return environment_pb2.CloseEpisodeResponse()


class _Registrar:
    """Keeps this server registered with EnvHub from a daemon thread."""

    def __init__(self, envhub_address: str, *, env_name: str, address: str, capacity: int) -> None:
        self._envhub_address = envhub_address
        self._request = envhub_pb2.RegisterEnvironmentRequest(
            env_name=env_name, address=address, capacity=capacity
        )
        self._channel = grpc.insecure_channel(envhub_address)
        self._stub = envhub_pb2_grpc.EnvHubServiceStub(self._channel)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"envhub-{env_name}", daemon=True)
        self.instance_id = ""
        self.renew_interval_s = 2.0
        self._log = log.bind(env=env_name, envhub=envhub_address)

    def start(self) -> None:
        """Register once now (UNAVAILABLE is retried in the background), then keep renewing."""
        try:
            self._register()
        except grpc.RpcError as err:
            if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._channel.close()
                raise InvalidArgumentError(
                    f"EnvHub at {self._envhub_address} refused the registration of "
                    f"'{self._request.env_name}': {err.code().name}: {err.details()}"
                ) from err
            self._log.warning("envhub_unreachable_retrying", code=err.code().name)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=_ENVHUB_CALL_TIMEOUT_S + 1)
        if self.instance_id:
            try:
                self._stub.DeregisterEnvironment(
                    envhub_pb2.DeregisterEnvironmentRequest(instance_id=self.instance_id),
                    timeout=2.0,
                )
            except grpc.RpcError as err:
                self._log.warning("deregister_failed", code=err.code().name)
        self._channel.close()

    def _register(self) -> None:
        reply = self._stub.RegisterEnvironment(self._request, timeout=_ENVHUB_CALL_TIMEOUT_S)
        self.instance_id = reply.instance.instance_id
        if reply.renew_interval_s > 0:
            self.renew_interval_s = reply.renew_interval_s
        self._log.info("registered", instance_id=self.instance_id)

    def _run(self) -> None:
        while not self._stop.wait(self.renew_interval_s):
            try:
                if self.instance_id:
                    self._renew()
                if not self.instance_id:
                    self._register()
            except grpc.RpcError as err:
                self._log.warning(
                    "envhub_call_failed", code=err.code().name, registered=bool(self.instance_id)
                )

    def _renew(self) -> None:
        """Renew; a NOT_FOUND answer (expired, or EnvHub restarted) clears ``instance_id``."""
        try:
            self._stub.RenewRegistration(
                envhub_pb2.RenewRegistrationRequest(instance_id=self.instance_id),
                timeout=_ENVHUB_CALL_TIMEOUT_S,
            )
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                raise
            self._log.info("registration_lost_registering_again", instance_id=self.instance_id)
            self.instance_id = ""


class EnvServerHandle:
    """A running environment server (what ``serve(..., block=False)`` returns)."""

    def __init__(
        self,
        server: grpc.Server,
        *,
        port: int,
        address: str,
        table: EpisodeTable,
        registrar: _Registrar | None,
    ) -> None:
        self.server = server
        self.port = port
        self.address = address  # host:port as registered with EnvHub
        self.table = table
        self._registrar = registrar
        self._stopped = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="episode-reaper", daemon=True)
        self._reaper.start()

    @property
    def instance_id(self) -> str:
        """The EnvHub instance id ('' when not registered, or not yet)."""
        return self._registrar.instance_id if self._registrar else ""

    def stop(self, grace_s: float = 1.0) -> None:
        """Deregister, stop serving (in-flight calls get ``grace_s``) and free every episode."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._registrar is not None:
            self._registrar.stop()
        self.server.stop(grace_s).wait()
        self.table.close_all()
        log.info("env_server_stopped", env=self.table.env_name, address=self.address)

    def wait(self) -> None:
        """Block until ``stop`` is called (from another thread or a signal)."""
        while not self._stopped.wait(0.5):
            pass

    def _reap(self) -> None:
        period = max(0.05, min(self.table.idle_timeout_s / 4, 30.0))
        while not self._stopped.wait(period):
            reaped = self.table.reap_idle()
            if reaped:
                log.info("episodes_reaped", env=self.table.env_name, count=len(reaped))


def serve(
    game_factory: GameFactory,
    *,
    name: str | None = None,
    envhub_address: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise_address: str | None = None,
    capacity: int = 64,
    idle_timeout_s: float = 600.0,
    max_workers: int | None = None,
    block: bool = True,
) -> EnvServerHandle:
    """Serve a game as an ``EnvironmentService``.

    game_factory: builds one game per episode (usually the ``AbstractGame`` subclass itself).
    name: the environment name (default: the game's ``name`` attribute).
    envhub_address: host:port of EnvHub to register with; None = do not register.
    host, port: where to listen; port 0 picks a free port (see ``handle.port``).
    advertise_address: the host:port EnvHub should dial (default: host:port, with the machine's
        host name when listening on all interfaces).
    capacity: live episodes at most; 0 = unlimited. idle_timeout_s: idle episodes are freed.
    max_workers: RPC threads (default: capacity + 8, or 72 when unlimited).
    block: serve until SIGINT/SIGTERM (then deregister and return the stopped handle); with
        False, return the running handle at once.
    """
    probe = game_factory()
    env_name = name or probe.name
    if not env_name or not ENV_NAME_PATTERN.match(env_name):
        raise InvalidArgumentError(
            f"environment name {env_name!r} is invalid: pass name= (letters, digits, _ . -)"
        )
    if capacity < 0 or idle_timeout_s <= 0:
        raise InvalidArgumentError("capacity must be >= 0 and idle_timeout_s > 0")
    spec = _spec_of(probe, env_name)
    _close_quietly(probe)

    table = EpisodeTable(
        game_factory, env_name=env_name, capacity=capacity, idle_timeout_s=idle_timeout_s
    )
    workers = max_workers or (capacity or 64) + 8
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"env-{env_name}"),
        options=_SERVER_OPTIONS,
    )
    environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(
        _EnvironmentServicer(table, spec), server
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection(
        [SERVICE_NAME, health_name, reflection.SERVICE_NAME], server
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind the environment server to {host}:{port}")
    server.start()
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    address = advertise_address or f"{_advertised_host(host)}:{bound}"
    log.info("env_server_started", env=env_name, address=address, capacity=capacity)

    registrar = None
    if envhub_address:
        registrar = _Registrar(
            envhub_address, env_name=env_name, address=address, capacity=capacity
        )
        try:
            registrar.start()
        except Exception:
            server.stop(0)
            raise
    handle = EnvServerHandle(server, port=bound, address=address, table=table, registrar=registrar)
    if block:
        _wait_for_signal(handle)
    return handle


def _spec_of(game: AbstractGame, env_name: str) -> environment_pb2.EnvironmentSpec:
    try:
        system_prompt = game.get_system_prompt()
    except Exception:  # a prompt that depends on reset() state; each ResetResponse carries it
        system_prompt = ""
    return environment_pb2.EnvironmentSpec(
        name=env_name,
        description=game.description,
        system_prompt=system_prompt if isinstance(system_prompt, str) else "",
        max_turns=game.max_turns,
    )


def _advertised_host(host: str) -> str:
    return socket.gethostname() if host in ("0.0.0.0", "::", "[::]", "") else host


def _wait_for_signal(handle: EnvServerHandle) -> None:
    def on_signal(signum: int, frame: object) -> None:
        threading.Thread(target=handle.stop, daemon=True).start()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    try:
        handle.wait()
    finally:
        handle.stop()
