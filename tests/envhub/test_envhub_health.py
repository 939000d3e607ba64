"""EnvHub's active health checks: real env servers on 127.0.0.1, a real EnvHub, real gRPC.

EnvHub checks every registered instance each 0.1 s here; two failed checks in a row make an
instance unhealthy (no new episodes), SERVING makes it healthy again, and a server without the
health service counts as healthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from envhub_helpers import Episodes, Hub, run
from envhub_helpers import envhub as any_envhub
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from opentinker.env_server import EnvServerHandle
from opentinker.env_servicer import EnvironmentServicer, spec_of
from opentinker.envhub.v1 import envhub_pb2 as hub_pb
from opentinker.envhub.v1 import environment_pb2_grpc
from opentinker.episode_table import EpisodeTable
from opentinker.services.envhub.games.letter_env import LetterGame
from opentinker.services.envhub.settings import EnvHubSettings

ENV = "letters"
INTERVAL_S = 0.1


def envhub() -> contextlib.AbstractAsyncContextManager[Hub]:
    return any_envhub(
        registration_ttl_s=60,  # hand-registered servers never renew
        health_check_interval_s=INTERVAL_S,
        health_check_timeout_s=0.5,
        unhealthy_after=2,
    )


async def serve_letters(hub: Hub) -> EnvServerHandle:
    """An SDK env server (health checking on) that registers and renews by itself."""
    return await hub.serve(LetterGame, name=ENV, capacity=64)


async def health_of(hub: Hub) -> dict[str, int]:
    """instance id -> InstanceHealth, as ListEnvironments reports it."""
    return {i.instance_id: i.health for i in await hub.instances()}


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


async def open_episodes(hub: Hub) -> Episodes:
    episodes = Episodes(hub)
    await episodes.open(ENV)
    return episodes


async def reset(episodes: Episodes, episode_id: str) -> hub_pb.RunEpisodesResponse:
    await episodes.reset(episode_id, seed=1)
    return await episodes.recv()


@pytest.mark.integration
def test_a_dead_instance_becomes_unhealthy_and_new_episodes_go_to_the_live_one() -> None:
    async def scenario() -> None:
        async with envhub() as hub:
            doomed, alive = await serve_letters(hub), await serve_letters(hub)
            try:
                await wait_for(lambda: len(hub.deps.registry.instances(ENV)) == 2, "both register")
                doomed.server.stop(0).wait()  # dead, yet its registration thread still renews
                took = await wait_for(
                    lambda: not hub.instance(doomed.instance_id).healthy, "doomed is unhealthy"
                )
                assert took < 10 * INTERVAL_S  # two failed checks, a round or two of slack
                assert hub.instance(alive.instance_id).healthy
                # Still registered and listed: only routing skips it.
                assert await health_of(hub) == {
                    doomed.instance_id: hub_pb.INSTANCE_HEALTH_NOT_SERVING,
                    alive.instance_id: hub_pb.INSTANCE_HEALTH_SERVING,
                }
                episodes = await open_episodes(hub)
                for n in range(4):  # least-loaded routing alone would send two to the dead one
                    reply = await reset(episodes, f"e{n}")
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
                flaky_id = await hub.register(ENV, flaky.address)
                flaky.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                with capture_logs() as logs:
                    await wait_for(lambda: not hub.instance(flaky_id).healthy, "flaky unhealthy")
                [event] = [e for e in logs if e["event"] == "instance_unhealthy"]
                assert event["address"] == flaky.address and "NOT_SERVING" in event["problem"]
                assert set(await health_of(hub)) == {flaky_id}

                episodes = await open_episodes(hub)
                failed = (await reset(episodes, "lonely")).failed
                assert failed.code == "RESOURCE_EXHAUSTED"
                assert "health checks" in failed.reason and flaky.address in failed.reason

                sdk = await serve_letters(hub)
                await wait_for(lambda: len(hub.deps.registry.instances(ENV)) == 2, "sdk registers")
                for n in range(3):
                    assert (await reset(episodes, f"a{n}")).WhichOneof("payload") == "reset"
                assert (len(flaky.table), len(sdk.table)) == (0, 3)

                flaky.health.set("", health_pb2.HealthCheckResponse.SERVING)
                with capture_logs() as logs:
                    await wait_for(lambda: hub.instance(flaky_id).healthy, "flaky healthy again")
                assert [e["event"] for e in logs] == ["instance_healthy_again"]
                for n in range(2):  # least loaded now: 0 episodes against 3
                    assert (await reset(episodes, f"b{n}")).WhichOneof("payload") == "reset"
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
            instance_id = await hub.register(ENV, first.address)
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
                    bare_id = await hub.register(ENV, bare.address)
                    await asyncio.sleep(8 * INTERVAL_S)  # several rounds of UNIMPLEMENTED
                assert hub.instance(bare_id).healthy
                told = [e for e in logs if e["event"].startswith("instance_has_no_health")]
                assert len(told) == 1 and told[0]["address"] == bare.address  # logged once
                assert not [e for e in logs if e["event"] == "instance_unhealthy"]
                episodes = await open_episodes(hub)
                assert (await reset(episodes, "e")).WhichOneof("payload") == "reset"
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
