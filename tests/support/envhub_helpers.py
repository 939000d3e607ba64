"""The EnvHub test harness: a real EnvHub served in the test's asyncio loop (env servers, in
threads, are started with asyncio.to_thread, since they register with EnvHub by blocking
calls), a RunEpisodes stream driven by plain awaits, and a slow or failing game. Used by
test_envhub.py, test_envhub_faults.py, test_envhub_lost_servers.py, test_envhub_batch.py and
test_vision_envhub.py. An EnvHub stopped and started again on its port (RestartableHub):
test_rollout_envhub_restart.py and test_infer_envhub_restart.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from identity_helpers import user_channel

from opentinker.env_auth import new_env_token
from opentinker.env_server import EnvServerHandle, serve
from opentinker.envhub.v1 import envhub_pb2 as hub_pb
from opentinker.envhub.v1 import envhub_pb2_grpc
from opentinker.envhub.v1 import environment_pb2 as env_pb
from opentinker.game import AbstractGame, StepResult
from opentinker.services.envhub.registry import Instance
from opentinker.services.envhub.server import EnvHubDeps, create_server
from opentinker.services.envhub.settings import EnvHubSettings


class SlowGame(AbstractGame):
    """Step sleeps for the number of seconds in the action ('0.0' is instant)."""

    name = "slow"

    def get_system_prompt(self) -> str:
        return ""

    def reset(self, *, seed: int = 0) -> str:
        return "go"

    def step(self, action: str) -> StepResult:
        if action == "boom":
            raise RuntimeError("out of cheese")
        time.sleep(float(action))
        return StepResult(observation="ok", reward=float(action), done=False)


@dataclass
class Hub:
    address: str
    deps: EnvHubDeps
    stub: envhub_pb2_grpc.EnvHubServiceStub

    async def serve(self, game: type[AbstractGame], **options: Any) -> EnvServerHandle:
        return await asyncio.to_thread(
            serve, game, envhub_address=self.address, block=False, **options
        )

    async def instances(self, env_name: str = "") -> list[hub_pb.EnvironmentInstance]:
        reply = await self.stub.ListEnvironments(hub_pb.ListEnvironmentsRequest(), timeout=5)
        return [i for i in reply.instances if not env_name or i.env_name == env_name]

    async def register(
        self, env_name: str, address: str, capacity: int = 64, *, env_token: str = ""
    ) -> str:
        """A server registered by hand (it never renews); its instance id. ``env_token``:
        what EnvHub presents to it (default: a fresh one a hand-made server ignores)."""
        reply = await self.stub.RegisterEnvironment(
            hub_pb.RegisterEnvironmentRequest(
                env_name=env_name,
                address=address,
                capacity=capacity,
                env_token=env_token or new_env_token(),
            ),
            timeout=5,
        )
        return reply.instance.instance_id

    def instance(self, instance_id: str) -> Instance:
        """EnvHub's own record of one instance (health, active episodes)."""
        [found] = [i for i in self.deps.registry.instances() if i.instance_id == instance_id]
        return found


@contextlib.asynccontextmanager
async def envhub(**settings: object) -> AsyncIterator[Hub]:
    config = EnvHubSettings(port=0, **{"builtin_envs": [], **settings})  # type: ignore[arg-type]
    deps = EnvHubDeps.create(config)
    server, port = await create_server(config, deps)
    address = f"127.0.0.1:{port}"
    async with user_channel(address) as channel:
        try:
            yield Hub(address, deps, envhub_pb2_grpc.EnvHubServiceStub(channel))
        finally:
            await server.stop(0)
            await deps.close()


class RestartableHub:
    """A real EnvHub that can be stopped and started again on the same port (its registry and
    episode routes die with it; builtin_envs are served again at each start)."""

    def __init__(self, builtin_envs: Sequence[str] = ()) -> None:
        self.port = 0
        self.builtin_envs = list(builtin_envs)
        self.deps: EnvHubDeps | None = None
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        settings = EnvHubSettings(
            port=self.port, builtin_envs=self.builtin_envs, renew_interval_s=0.5
        )
        self.deps = EnvHubDeps.create(settings)
        self._server, self.port = await create_server(settings, self.deps)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        if self.deps is not None:
            await self.deps.close()

    def instances(self, env_name: str) -> int:
        """Instances of ``env_name`` registered now."""
        return 0 if self.deps is None else len(self.deps.registry.instances(env_name))


class Episodes:
    """A RunEpisodes stream driven by plain awaits."""

    def __init__(self, hub: Hub) -> None:
        self.call = hub.stub.RunEpisodes(timeout=60)
        self.seq = 0

    async def send(self, **payload: Any) -> None:
        self.seq += 1
        await self.call.write(hub_pb.RunEpisodesRequest(seq=self.seq, **payload))

    async def recv(self, timeout_s: float = 5.0) -> hub_pb.RunEpisodesResponse:
        reply = await asyncio.wait_for(self.call.read(), timeout_s)
        assert reply is not grpc.aio.EOF, "the stream ended"
        return reply

    async def open(self, env_name: str) -> env_pb.EnvironmentSpec:
        await self.send(open=hub_pb.OpenEpisodes(job_id="job-1", env_name=env_name))
        return (await self.recv()).opened.spec

    async def reset(self, episode_id: str, seed: int = 0, **options: str) -> None:
        await self.send(
            reset=env_pb.ResetRequest(episode_id=episode_id, seed=seed, options=options)
        )

    async def step(self, episode_id: str, action: str) -> None:
        await self.send(step=env_pb.StepRequest(episode_id=episode_id, action=action))


def run(coro) -> None:  # noqa: ANN001 - a coroutine
    asyncio.run(asyncio.wait_for(coro, 60))
