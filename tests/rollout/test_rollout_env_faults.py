"""The rollout when its environment fails, over real gRPC with a real EnvHub and env servers:
an unknown or dead env fails the rollout naming it; EnvHub dying mid-step fails the waiting
episode within seconds."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from identity_helpers import user_key
from rollout_service_helpers import Countdown, Trainer, mesh, run

from opentinker.env_server import serve
from opentinker.errors import UnavailableError
from opentinker.game import StepResult
from opentinker.rollout.v1 import rollout_pb2
from opentinker.services.envhub.server import EnvHubDeps
from opentinker.services.envhub.server import create_server as create_envhub
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.rollout.envs.envhub_client import EnvHubClient

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


def test_unknown_or_dead_environment_fails_the_rollout_naming_it(model_dir: Path) -> None:
    async def scenario() -> None:
        async with mesh(env_timeout_s=5.0) as m:
            trainer = Trainer(m.rollout_address)
            try:
                started = time.monotonic()
                failed = (await trainer.open(model_dir, env_name="chess")).failed
                assert failed.code == "NOT_FOUND" and "'chess'" in failed.reason
                assert time.monotonic() - started < 5
            finally:
                await trainer.close()

            # Every episode fails in the environment: the batch fails, naming it and the error.
            trainer = Trainer(m.rollout_address)
            try:
                assert (await trainer.open(model_dir, env_name="broken")).HasField("opened")
                await trainer.send(
                    collect=rollout_pb2.CollectTrajectories(num_groups=2, group_size=2)
                )
                failed = (await trainer.recv()).failed
                assert failed.code == "UNAVAILABLE"
                assert "4 of 4 episodes of environment 'broken'" in failed.reason
                assert "out of cheese" in failed.reason
                assert await trainer.ended()
            finally:
                await trainer.close()

            # The env server dies without deregistering.
            trainer = Trainer(m.rollout_address)
            try:
                assert (await trainer.open(model_dir)).HasField("opened")
                await asyncio.to_thread(lambda: m.env.server.stop(0).wait())
                started = time.monotonic()
                await trainer.send(
                    collect=rollout_pb2.CollectTrajectories(num_groups=2, group_size=2)
                )
                failed = (await trainer.recv()).failed
                assert failed.code == "UNAVAILABLE" and "'countdown'" in failed.reason
                assert time.monotonic() - started < 8
                assert await trainer.ended()
            finally:
                await trainer.close()

            # EnvHub itself goes away.
            trainer = Trainer(m.rollout_address)
            try:
                await m.envhub.stop(0)
                started = time.monotonic()
                failed = (await trainer.open(model_dir)).failed
                assert failed.code == "UNAVAILABLE" and "'countdown'" in failed.reason
                assert m.envhub_address in failed.reason
                assert time.monotonic() - started < 8
            finally:
                await trainer.close()

    run(scenario())


class Sleepy(Countdown):
    name = "sleepy"

    def step(self, action: str) -> StepResult:
        time.sleep(3)
        return super().step(action)


def test_envhub_dying_mid_step_fails_the_waiting_episode_within_seconds() -> None:
    async def scenario() -> None:
        settings = EnvHubSettings(port=0, builtin_envs=[])
        deps = EnvHubDeps.create(settings)
        hub, port = await create_envhub(settings, deps)
        env = await asyncio.to_thread(
            serve, Sleepy, envhub_address=f"127.0.0.1:{port}", block=False
        )
        client = EnvHubClient(
            f"127.0.0.1:{port}", credential=user_key(), job_id="j", env_name="sleepy", timeout_s=10
        )
        try:
            spec = await client.open()
            assert spec.name == "sleepy"
            episode = client.session("e1")
            reset = await episode.reset(seed=1, options={"start": "7"})
            assert reset.observation == "Start at 7."
            step = asyncio.create_task(episode.step("6"))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            await hub.stop(0)
            with pytest.raises(UnavailableError, match="'sleepy'"):
                await step
            assert time.monotonic() - started < 2
            with pytest.raises(UnavailableError):  # the stream is gone: later calls fail at once
                await client.session("e2").reset(seed=2, options={})
        finally:
            await client.close()
            await asyncio.to_thread(env.stop, 0)
            await deps.close()

    run(scenario())
