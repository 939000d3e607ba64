"""One gRPC channel per env instance address, shared by every RunEpisodes stream.

EnvHub's built-in envs are reached in-process (``add_local``), registered env servers over a
channel opened the first time an episode goes to them.
"""

from __future__ import annotations

import asyncio

import grpc

from opentinker.envhub.v1 import environment_pb2_grpc
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.envhub.local_envs import LocalEnvironmentStub


class EnvChannels:
    """One channel per env instance address, shared by every stream."""

    def __init__(self) -> None:
        self._stubs: dict[str, environment_pb2_grpc.EnvironmentServiceStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def add_local(self, address: str, stub: LocalEnvironmentStub) -> None:
        """Reach the env served at ``address`` in-process (EnvHub's built-ins)."""
        self._stubs[address] = stub  # type: ignore[assignment]  # same call interface

    def stub(self, address: str) -> environment_pb2_grpc.EnvironmentServiceStub:
        if address not in self._stubs:
            channel = aio_channel(address)
            self._channels.append(channel)
            self._stubs[address] = environment_pb2_grpc.EnvironmentServiceStub(channel)
        return self._stubs[address]

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels), return_exceptions=True)
        self._channels.clear()
        for stub in self._stubs.values():
            if isinstance(stub, LocalEnvironmentStub):
                stub.close()
        self._stubs.clear()
