"""Build EnvHub: its dependencies and its gRPC server."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health

from opentinker.env_server import EnvServerHandle
from opentinker.env_servicer import EnvironmentServicer, spec_of
from opentinker.envhub.v1 import envhub_pb2, envhub_pb2_grpc
from opentinker.services.common.auth import AuthInterceptor, IdentityServiceAuthenticator
from opentinker.services.common.grpc_server import aio_channel, create_aio_server, mark_serving
from opentinker.services.envhub.builtin_envs import (
    BUILTIN_GAMES,
    INLINE_BUILTINS,
    start_builtin_envs,
)
from opentinker.services.envhub.env_channels import EnvChannels
from opentinker.services.envhub.health_watch import HealthWatch
from opentinker.services.envhub.local_envs import LocalEnvironmentStub
from opentinker.services.envhub.registry import InMemoryRegistry, Registry
from opentinker.services.envhub.servicer import ACCESS_RULES, EnvHubServicer
from opentinker.services.envhub.settings import EnvHubSettings

SERVICE_NAME = envhub_pb2.DESCRIPTOR.services_by_name["EnvHubService"].full_name


@dataclass
class EnvHubDeps:
    """What EnvHub runs on: the registry, channels to env instances, the built-in env servers,
    and the health watch over registered instances (started by ``create_server``)."""

    registry: Registry
    channels: EnvChannels = field(default_factory=EnvChannels)
    builtins: list[EnvServerHandle] = field(default_factory=list)
    health_watch: HealthWatch | None = None
    identity_channel: grpc.aio.Channel | None = None  # to the scheduler; made by create_server

    @classmethod
    def create(cls, settings: EnvHubSettings) -> EnvHubDeps:
        """An in-memory registry with the settings' built-in envs served and registered."""
        registry = InMemoryRegistry(ttl_s=settings.registration_ttl_s)
        builtins = start_builtin_envs(
            settings.builtin_envs,
            registry,
            capacity=settings.builtin_capacity,
            max_observation_chars=settings.max_observation_chars,
        )
        channels = EnvChannels()
        for name, handle in zip(settings.builtin_envs, builtins, strict=True):
            spec = spec_of(BUILTIN_GAMES[name](), name)
            channels.add_local(
                handle.address,
                LocalEnvironmentStub(
                    EnvironmentServicer(handle.table, spec),
                    max_workers=(settings.builtin_capacity or 64) + 8,  # as serve() sizes it
                    inline=name in INLINE_BUILTINS,
                ),
            )
        health_watch = HealthWatch(
            registry,
            interval_s=settings.health_check_interval_s,
            unhealthy_after=settings.unhealthy_after,
            timeout_s=settings.health_check_timeout_s,
        )
        return cls(
            registry=registry, channels=channels, builtins=builtins, health_watch=health_watch
        )

    async def close(self) -> None:
        """Stop the health watch, close channels, stop the built-in env servers."""
        if self.health_watch is not None:
            await self.health_watch.stop()
        if self.identity_channel is not None:
            await self.identity_channel.close()
        await self.channels.close()
        for handle in self.builtins:
            handle.stop(grace_s=0.5)


@dataclass
class BoundEnvHub:
    """EnvHub's gRPC server bound to its port, not started yet: no servicer, no deps."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    identity_channel: grpc.aio.Channel  # to the scheduler, which checks every credential


async def bind_envhub(settings: EnvHubSettings) -> BoundEnvHub:
    """Hold settings.host:settings.port (0 = any free port) before anything else of EnvHub's
    binds: its built-in env servers take ports of their own (port 0), and one could otherwise
    draw a port chosen for EnvHub in advance (by whoever starts it with a fixed port).
    OSError when the port is taken, with the channel to the scheduler it opened closed again."""
    identity_channel = aio_channel(settings.scheduler_address)
    auth = AuthInterceptor(
        IdentityServiceAuthenticator(identity_channel, address=settings.scheduler_address),
        ACCESS_RULES,
        recheck_streams_s=settings.credential_recheck_s,
    )
    try:
        server, port, health_servicer = create_aio_server(
            [SERVICE_NAME], host=settings.host, port=settings.port, interceptors=[auth]
        )
    except BaseException:
        await identity_channel.close()
        raise
    return BoundEnvHub(server, port, health_servicer, identity_channel)


async def start_envhub(
    bound: BoundEnvHub, settings: EnvHubSettings, deps: EnvHubDeps
) -> tuple[grpc.aio.Server, int]:
    """Serve ``deps`` on the bound server, with the health watch of ``deps`` running
    (``deps.close()`` stops it and closes the channel to the scheduler)."""
    deps.identity_channel = bound.identity_channel
    servicer = EnvHubServicer(settings, deps.registry, deps.channels)
    envhub_pb2_grpc.add_EnvHubServiceServicer_to_server(servicer, bound.server)
    await bound.server.start()
    await mark_serving(bound.health, [SERVICE_NAME])
    if deps.health_watch is not None:
        deps.health_watch.start()
    return bound.server, bound.port


async def create_server(settings: EnvHubSettings, deps: EnvHubDeps) -> tuple[grpc.aio.Server, int]:
    """A started EnvHub server on settings.host:settings.port (0 = any free port) serving
    ``deps`` (bind_envhub, then start_envhub). Every caller's credential is checked by the
    scheduler's IdentityService at settings.scheduler_address, a stream's again every
    settings.credential_recheck_s while it lasts."""
    return await start_envhub(await bind_envhub(settings), settings, deps)
