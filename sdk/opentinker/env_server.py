"""Serve an ``AbstractGame`` as an ``EnvironmentService`` gRPC server, optionally registered
with EnvHub.

    serve(MyGame, name="my-game", envhub_address="localhost:50052")   # blocks until Ctrl-C

The pieces: ``episode_table`` (one game per episode, validation, idle reaping: the rules of
Reset/Step/Close live there), ``env_servicer`` (protobuf <-> table), ``envhub_registration``
(register, renew, deregister), ``env_auth`` (the env token: every ``EnvironmentService`` call
must present the token the server registered with EnvHub, or is refused UNAUTHENTICATED).
Every RPC runs on its own thread of a pool, so one slow ``step`` never stalls other episodes.
Nothing here imports torch or the server extras.
"""

from __future__ import annotations

import re
import signal
import socket
import threading
from concurrent import futures

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from opentinker.auth import api_key_from_env
from opentinker.env_auth import (
    EnvTokenInterceptor,
    env_token_problem,
    new_env_token,
    with_env_token,
)
from opentinker.env_servicer import SERVICE_NAME, EnvironmentServicer, spec_of
from opentinker.envhub.v1 import environment_pb2, environment_pb2_grpc
from opentinker.envhub_registration import EnvHubRegistration
from opentinker.episode_table import (
    DEFAULT_MAX_OBSERVATION_CHARS,
    EpisodeTable,
    GameFactory,
    close_quietly,
)
from opentinker.errors import InvalidArgumentError
from opentinker.grpc_options import bind, host_port, server_options

__all__ = ["ENV_NAME_PATTERN", "EnvServerHandle", "EpisodeTable", "GameFactory", "serve"]

ENV_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]+$")

log = structlog.get_logger("opentinker.env_server")


class EnvServerHandle:
    """A running environment server (what ``serve(..., block=False)`` returns)."""

    def __init__(
        self,
        server: grpc.Server,
        *,
        port: int,
        address: str,
        table: EpisodeTable,
        registration: EnvHubRegistration | None,
        env_token: str,
    ) -> None:
        self.server = server
        self.port = port
        self.address = address  # host:port as registered with EnvHub
        self.table = table
        self._registration = registration
        # What every EnvironmentService call must present (env_auth.py); not in any repr.
        self._env_token = env_token
        self._stopped = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="episode-reaper", daemon=True)
        self._reaper.start()

    @property
    def instance_id(self) -> str:
        """The EnvHub instance id ('' when not registered, or not yet)."""
        return self._registration.instance_id if self._registration else ""

    @property
    def env_token(self) -> str:
        """The secret every ``EnvironmentService`` call must present (registered with EnvHub)."""
        return self._env_token

    def channel(self) -> grpc.Channel:
        """A blocking channel to this server that presents its env token: for direct calls
        (tests, debugging). Close it when done (or use it as a context manager)."""
        return with_env_token(grpc.insecure_channel(self.address), self._env_token)

    def stop(self, grace_s: float = 1.0) -> None:
        """Deregister, stop serving (in-flight calls get ``grace_s``) and free every episode."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._registration is not None:
            self._registration.stop()
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
    api_key: str | None = None,
    shared: bool = False,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise_address: str | None = None,
    capacity: int = 64,
    idle_timeout_s: float = 600.0,
    max_workers: int | None = None,
    max_observation_chars: int = DEFAULT_MAX_OBSERVATION_CHARS,
    env_token: str | None = None,
    block: bool = True,
) -> EnvServerHandle:
    """Serve a game as an ``EnvironmentService``.

    game_factory: builds one game per episode (usually the ``AbstractGame`` subclass itself).
    name: the environment name (default: the game's ``name`` attribute).
    envhub_address: host:port of EnvHub to register with; None = do not register.
    api_key: the key to register with (default: $OPENTINKER_API_KEY). The env is then private
        to the key's tenant; ``shared=True`` (an admin's key only) offers it to every tenant.
    host, port: where to listen; port 0 picks a free port (see ``handle.port``).
    advertise_address: the host:port EnvHub should dial (default: host:port, with the machine's
        host name when listening on all interfaces).
    capacity: live episodes at most; 0 = unlimited. idle_timeout_s: idle episodes are freed.
    max_workers: RPC threads (default: capacity + 8, or 72 when unlimited).
    max_observation_chars: a longer observation is never sent; the episode fails with an error
        naming the size instead (0 = no limit). EnvHub applies its own limit as well.
    env_token: the secret every ``EnvironmentService`` call must present (metadata
        ``opentinker-env-token``; env_auth.py); None = a fresh random one. It is registered
        with EnvHub, which presents it; any other caller is refused UNAUTHENTICATED (health
        checks stay open). ``handle.env_token`` holds it; ``handle.channel()`` presents it.
    block: serve until SIGINT/SIGTERM (then deregister and return the stopped handle); with
        False, return the running handle at once.
    """
    token = new_env_token() if env_token is None else env_token
    if (problem := env_token_problem(token)) is not None:
        raise InvalidArgumentError(problem)
    table, spec = _episode_table(
        game_factory,
        name=name,
        capacity=capacity,
        idle_timeout_s=idle_timeout_s,
        max_observation_chars=max_observation_chars,
    )
    server, bound = _start_grpc_server(
        EnvironmentServicer(table, spec),
        EnvTokenInterceptor(token, env_name=table.env_name),
        host=host,
        port=port,
        max_workers=max_workers or (capacity or 64) + 8,
        thread_name_prefix=f"env-{table.env_name}",
    )
    address = advertise_address or host_port(_advertised_host(host), bound)
    log.info("env_server_started", env=table.env_name, address=address, capacity=capacity)

    registration = None
    if envhub_address:
        registration = EnvHubRegistration(
            envhub_address,
            env_name=table.env_name,
            address=address,
            capacity=capacity,
            api_key=api_key_from_env(api_key),
            shared=shared,
            env_token=token,
        )
        _start_registration(registration, server)
    handle = EnvServerHandle(
        server,
        port=bound,
        address=address,
        table=table,
        registration=registration,
        env_token=token,
    )
    if block:
        _wait_for_signal(handle)
    return handle


def _episode_table(
    game_factory: GameFactory,
    *,
    name: str | None,
    capacity: int,
    idle_timeout_s: float,
    max_observation_chars: int,
) -> tuple[EpisodeTable, environment_pb2.EnvironmentSpec]:
    """The table of episodes and the environment's spec, from one game built to describe it;
    InvalidArgumentError for a name EnvHub would refuse or a limit out of range."""
    if capacity < 0 or idle_timeout_s <= 0 or max_observation_chars < 0:
        raise InvalidArgumentError(
            "capacity and max_observation_chars must be >= 0 and idle_timeout_s > 0"
        )
    probe = game_factory()
    try:
        env_name = name or probe.name
        if not env_name or not ENV_NAME_PATTERN.match(env_name):
            raise InvalidArgumentError(
                f"environment name {env_name!r} is invalid: pass name= (letters, digits, _ . -)"
            )
        spec = spec_of(probe, env_name)
    finally:
        close_quietly(probe)
    table = EpisodeTable(
        game_factory,
        env_name=env_name,
        capacity=capacity,
        idle_timeout_s=idle_timeout_s,
        max_observation_chars=max_observation_chars,
    )
    return table, spec


def _start_registration(registration: EnvHubRegistration, server: grpc.Server) -> None:
    """Register with EnvHub (and keep renewing); a refusal stops ``server`` and is raised."""
    try:
        registration.start()
    except Exception:
        server.stop(0)
        raise


def _start_grpc_server(
    servicer: EnvironmentServicer,
    auth: EnvTokenInterceptor,
    *,
    host: str,
    port: int,
    max_workers: int,
    thread_name_prefix: str,
) -> tuple[grpc.Server, int]:
    """A started threaded gRPC server with the servicer behind ``auth``, health checking and
    reflection (those two open)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name_prefix),
        interceptors=[auth],
        options=server_options(),  # an EnvHub that vanished lets its games go
    )
    environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection(
        [SERVICE_NAME, health_name, reflection.SERVICE_NAME], server
    )
    bound = bind(server, host_port(host, port), what="the environment server")
    server.start()
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


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
