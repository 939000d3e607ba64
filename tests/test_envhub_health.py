"""EnvHub's active health checks: real env servers on 127.0.0.1, a real EnvHub, real gRPC.

EnvHub checks every registered instance each 0.1 s here; two failed checks in a row make an
instance unhealthy (no new episodes), SERVING makes it healthy again, and a server without the
health service counts as healthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from identity_helpers import user_channel
from structlog.testing import capture_logs

from opentinker.env_server import EnvServerHandle, serve
from opentinker.env_servicer import EnvironmentServicer, spec_of
from opentinker.envhub.v1 import envhub_pb2 as hub_pb
from opentinker.envhub.v1 import envhub_pb2_grpc, environment_pb2_grpc
from opentinker.envhub.v1 import environment_pb2 as env_pb
from opentinker.episode_table import EpisodeTable
from opentinker.services.envhub.games.letter_env import LetterGame
from opentinker.services.envhub.registry import Instance
from opentinker.services.envhub.server import EnvHubDeps, create_server
from opentinker.services.envhub.settings import EnvHubSettings

ENV = "letters"
INTERVAL_S = 0.1


@dataclass
class Hub:
    address: str
    deps: EnvHubDeps
    stub: envhub_pb2_grpc.EnvHubServiceStub

    async def serve_sdk(self) -> EnvServerHandle:
        """An SDK env server (health checking on) that registers and renews by itself."""
        return await asyncio.to_thread(
            serve, LetterGame, name=ENV, envhub_address=self.address, capacity=64, block=False
        )

    async def register(self, address: str) -> str:
        reply = await self.stub.RegisterEnvironment(
            hub_pb.RegisterEnvironmentRequest(env_name=ENV, address=address, capacity=64),
            timeout=5,
        )
        return reply.instance.instance_id

    def instance(self, instance_id: str) -> Instance:
        [found] = [i for i in self.deps.registry.instances(ENV) if i.instance_id == instance_id]
        return found

    async def listed(self) -> set[str]:
        return set(await self.health())

    async def health(self) -> dict[str, int]:
        """instance id -> InstanceHealth, as ListEnvironments reports it."""
        reply = await self.stub.ListEnvironments(hub_pb.ListEnvironmentsRequest(), timeout=5)
        return {i.instance_id: i.health for i in reply.instances}


@contextlib.asynccontextmanager
async def envhub() -> AsyncIterator[Hub]:
    settings = EnvHubSettings(
        port=0,
        builtin_envs=[],
        registration_ttl_s=60,  # hand-registered servers never renew
        health_check_interval_s=INTERVAL_S,
        health_check_timeout_s=0.5,
        unhealthy_after=2,
    )
    deps = EnvHubDeps.create(settings)
    server, port = await create_server(settings, deps)
    address = f"127.0.0.1:{port}"
    async with user_channel(address) as channel:
        try:
            yield Hub(address, deps, envhub_pb2_grpc.EnvHubServiceStub(channel))
        finally:
            await server.stop(0)
            await deps.close()


@dataclass
class HandMadeServer:
    """An EnvironmentService with a health service we drive (or none at all)."""

    server: grpc.Server
    address: str
    table: EpisodeTable
    health: health.HealthServicer | None


def hand_made_server(*, with_health: bool, port: int = 0) -> HandMadeServer:
    table = EpisodeTable(LetterGame, env_name=ENV, capacity=64, idle_timeout_s=60)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    servicer = EnvironmentServicer(table, spec_of(LetterGame(), ENV))
    environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(servicer, server)
    health_servicer = None
    if with_health:
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    assert bound, f"port {port} is taken"
    server.start()
    return HandMadeServer(server, f"127.0.0.1:{bound}", table, health_servicer)


async def wait_for(condition: Callable[[], bool], what: str, *, within_s: float = 3.0) -> float:
    """Seconds until ``condition()`` held; fails naming ``what`` after ``within_s``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < within_s, f"{what} not within {within_s} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


class Episodes:
    """A RunEpisodes stream on which resets are sent and their replies read one by one."""

    def __init__(self, hub: Hub) -> None:
        self.call = hub.stub.RunEpisodes(timeout=30)
        self.seq = 0

    async def send(self, **payload: Any) -> None:
        self.seq += 1
        await self.call.write(hub_pb.RunEpisodesRequest(seq=self.seq, **payload))

    async def open(self) -> None:
        await self.send(open=hub_pb.OpenEpisodes(job_id="job-h", env_name=ENV))
        reply = await asyncio.wait_for(self.call.read(), 5)
        assert reply.WhichOneof("payload") == "opened"

    async def reset(self, episode_id: str) -> hub_pb.RunEpisodesResponse:
        await self.send(reset=env_pb.ResetRequest(episode_id=episode_id, seed=1))
        reply = await asyncio.wait_for(self.call.read(), 5)
        assert reply is not grpc.aio.EOF
        return reply


def run(coro) -> None:  # noqa: ANN001 - a coroutine
    asyncio.run(asyncio.wait_for(coro, 30))


@pytest.mark.integration
def test_a_dead_instance_becomes_unhealthy_and_new_episodes_go_to_the_live_one() -> None:
    async def scenario() -> None:
        async with envhub() as hub:
            doomed, alive = await hub.serve_sdk(), await hub.serve_sdk()
            try:
                await wait_for(lambda: len(hub.deps.registry.instances(ENV)) == 2, "both register")
                doomed.server.stop(0).wait()  # dead, yet its registration thread still renews
                took = await wait_for(
                    lambda: not hub.instance(doomed.instance_id).healthy, "doomed is unhealthy"
                )
                assert took < 10 * INTERVAL_S  # two failed checks, a round or two of slack
                assert hub.instance(alive.instance_id).healthy
                # Still registered and listed: only routing skips it.
                assert await hub.health() == {
                    doomed.instance_id: hub_pb.INSTANCE_HEALTH_NOT_SERVING,
                    alive.instance_id: hub_pb.INSTANCE_HEALTH_SERVING,
                }
                episodes = Episodes(hub)
                await episodes.open()
                for n in range(4):  # least-loaded routing alone would send two to the dead one
                    reply = await episodes.reset(f"e{n}")
                    assert reply.WhichOneof("payload") == "reset", reply
                assert len(alive.table) == 4
                assert hub.instance(alive.instance_id).active_episodes == 4
            finally:
                await asyncio.gather(
                    asyncio.to_thread(doomed.stop, 0), asyncio.to_thread(alive.stop, 0)
                )

    run(scenario())


@pytest.mark.integration
def test_a_not_serving_instance_is_skipped_until_it_serves_again() -> None:
    async def scenario() -> None:
        async with envhub() as hub:
            flaky = hand_made_server(with_health=True)
            assert flaky.health is not None
            sdk: EnvServerHandle | None = None
            try:
                flaky_id = await hub.register(flaky.address)
                flaky.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                with capture_logs() as logs:
                    await wait_for(lambda: not hub.instance(flaky_id).healthy, "flaky unhealthy")
                [event] = [e for e in logs if e["event"] == "instance_unhealthy"]
                assert event["address"] == flaky.address and "NOT_SERVING" in event["problem"]
                assert await hub.listed() == {flaky_id}

                episodes = Episodes(hub)
                await episodes.open()
                failed = (await episodes.reset("lonely")).failed
                assert failed.code == "RESOURCE_EXHAUSTED"
                assert "health checks" in failed.reason and flaky.address in failed.reason

                sdk = await hub.serve_sdk()
                await wait_for(lambda: len(hub.deps.registry.instances(ENV)) == 2, "sdk registers")
                for n in range(3):
                    assert (await episodes.reset(f"a{n}")).WhichOneof("payload") == "reset"
                assert (len(flaky.table), len(sdk.table)) == (0, 3)

                flaky.health.set("", health_pb2.HealthCheckResponse.SERVING)
                with capture_logs() as logs:
                    await wait_for(lambda: hub.instance(flaky_id).healthy, "flaky healthy again")
                assert [e["event"] for e in logs] == ["instance_healthy_again"]
                for n in range(2):  # least loaded now: 0 episodes against 3
                    assert (await episodes.reset(f"b{n}")).WhichOneof("payload") == "reset"
                assert (len(flaky.table), len(sdk.table)) == (2, 3)
            finally:
                flaky.server.stop(0).wait()
                if sdk is not None:
                    await asyncio.to_thread(sdk.stop, 0)

    run(scenario())


@pytest.mark.integration
def test_a_server_back_at_the_same_address_is_healthy_again_at_once() -> None:
    async def scenario() -> None:
        async with envhub() as hub:
            first = hand_made_server(with_health=True)
            instance_id = await hub.register(first.address)
            first.server.stop(0).wait()
            await wait_for(lambda: not hub.instance(instance_id).healthy, "dead is unhealthy")
            await asyncio.sleep(1.5)  # failing all along: gRPC's reconnect backoff grows
            port = int(first.address.rpartition(":")[2])
            second = hand_made_server(with_health=True, port=port)
            try:
                took = await wait_for(lambda: hub.instance(instance_id).healthy, "back")
                assert took < 5 * INTERVAL_S  # each failed check dials afresh next round
            finally:
                second.server.stop(0).wait()

    run(scenario())


@pytest.mark.integration
def test_an_instance_without_the_health_service_stays_routable() -> None:
    async def scenario() -> None:
        async with envhub() as hub:
            bare = hand_made_server(with_health=False)
            try:
                with capture_logs() as logs:
                    bare_id = await hub.register(bare.address)
                    await asyncio.sleep(8 * INTERVAL_S)  # several rounds of UNIMPLEMENTED
                assert hub.instance(bare_id).healthy
                told = [e for e in logs if e["event"].startswith("instance_has_no_health")]
                assert len(told) == 1 and told[0]["address"] == bare.address  # logged once
                assert not [e for e in logs if e["event"] == "instance_unhealthy"]
                episodes = Episodes(hub)
                await episodes.open()
                assert (await episodes.reset("e")).WhichOneof("payload") == "reset"
                assert len(bare.table) == 1
            finally:
                bare.server.stop(0).wait()

    run(scenario())


@pytest.mark.unit
def test_health_settings_defaults_and_zero_disables() -> None:
    settings = EnvHubSettings()
    assert (settings.health_check_interval_s, settings.unhealthy_after) == (2.0, 2)
    assert EnvHubSettings(health_check_interval_s=0).health_check_interval_s == 0
    with pytest.raises(ValueError, match="unhealthy_after"):
        EnvHubSettings(unhealthy_after=0)
