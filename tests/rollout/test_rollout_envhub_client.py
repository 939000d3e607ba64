"""The rollout's EnvHub client against a real EnvHub and a real SDK env server (no model)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from identity_helpers import user_key

from opentinker.env_server import serve
from opentinker.envhub.v1 import envhub_pb2, environment_pb2
from opentinker.services.common.grpc_server import create_aio_server
from opentinker.services.envhub.games.letter_env import LetterGame
from opentinker.services.envhub.server import EnvHubDeps, create_server
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.rollout.agent.env_replies import EnvLinkLostError
from opentinker.services.rollout.envs.envhub_client import EnvHubClient

pytestmark = pytest.mark.integration


async def episode(client: EnvHubClient, episode_id: str) -> None:
    session = client.session(episode_id)
    await session.reset(7, {})
    assert (await session.step("A")).done
    await session.close()


def test_closing_the_stream_leaves_no_episode_on_the_env_server() -> None:
    """Closes sent just before the stream ends reach the env server (a cancelled stream used
    to cut some short: about 4% of episodes stayed on the server until its idle reaper)."""

    async def scenario() -> list[int]:
        settings = EnvHubSettings(port=0, builtin_envs=[])
        deps = EnvHubDeps.create(settings)
        hub, port = await create_server(settings, deps)
        address = f"127.0.0.1:{port}"
        env = await asyncio.to_thread(
            serve, LetterGame, envhub_address=address, capacity=0, block=False
        )
        live = []
        try:
            for batch in range(6):
                async with EnvHubClient(
                    address, credential=user_key(), job_id="j", env_name="letter"
                ) as client:
                    await asyncio.gather(*(episode(client, f"b{batch}-e{i}") for i in range(64)))
                live.append(len(env.table))
        finally:
            await asyncio.to_thread(env.stop, 0)
            await hub.stop(0)
            await deps.close()
        return live

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == [0] * 6


def test_a_reply_that_does_not_parse_breaks_the_stream_at_once_naming_it() -> None:
    """A hub written elsewhere (any gRPC language may serve EnvHub's protocol) answers a
    Reset with bytes that are no RunEpisodesResponse. gRPC hands the reader None for them;
    the reader died on it silently, so the Reset waited its whole deadline, the stream still
    looked healthy (the link kept it: every restarted episode timed out the same way) and the
    error named a timeout. Now the stream is broken at once, with a reason naming the reply."""

    async def run_episodes(requests, context):  # noqa: ANN001, ARG001 - grpc's handler shape
        async for raw in requests:
            request = envhub_pb2.RunEpisodesRequest.FromString(raw)
            if request.HasField("open"):
                spec = environment_pb2.EnvironmentSpec(name="letter")
                opened = envhub_pb2.EpisodesOpened(spec=spec)
                yield envhub_pb2.RunEpisodesResponse(seq=1, opened=opened).SerializeToString()
            elif request.HasField("calls"):
                yield b"\xff\xff\xff"  # a truncated varint: no message parses from it

    async def scenario() -> None:
        handler = grpc.method_handlers_generic_handler(
            "opentinker.envhub.v1.EnvHubService",
            {"RunEpisodes": grpc.stream_stream_rpc_method_handler(run_episodes)},
        )
        server, port, _ = create_aio_server([], host="127.0.0.1", port=0)
        server.add_generic_rpc_handlers((handler,))
        await server.start()
        try:
            address = f"127.0.0.1:{port}"
            async with EnvHubClient(address, job_id="j", env_name="letter", timeout_s=30) as client:
                with pytest.raises(EnvLinkLostError, match="does not parse as RunEpisodesResponse"):
                    await asyncio.wait_for(client.session("e0").reset(7, {}), 10)
                assert client.broken is not None
        finally:
            await server.stop(0)

    asyncio.run(scenario())
