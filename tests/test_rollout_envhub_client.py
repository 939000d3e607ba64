"""The rollout's EnvHub client against a real EnvHub and a real SDK env server (no model)."""

from __future__ import annotations

import asyncio

import pytest
from identity_helpers import user_key

from opentinker.env_server import serve
from opentinker.services.envhub.games.letter_env import LetterGame
from opentinker.services.envhub.server import EnvHubDeps, create_server
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.rollout.envhub_client import EnvHubClient

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
