"""Dead-instance failover: two real env servers under one name behind a real EnvHub, one of
them a separate process killed (SIGKILL) while its episodes wait in ``step``. The rollout
restarts those episodes from Reset on the survivor; with no instance left the batch fails
naming the environment. Nothing hangs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from rollout_helpers import assert_one_prompt_per_group, open_two_turn_session, tiny_engine

from opentinker.env_server import EnvServerHandle, serve
from opentinker.game import AbstractGame, StepResult
from opentinker.services.envhub.server import EnvHubDeps
from opentinker.services.envhub.server import create_server as create_envhub
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.session import EnvBatchFailedError, RolloutSession
from opentinker.services.rollout.types import FinishReason

pytestmark = pytest.mark.integration

ENV_NAME = "fragile"

# The doomed instance: a separate process that prints its port once registered, and whose
# step announces itself, then blocks until the test kills the process.
DOOMED_SERVER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from opentinker.env_server import serve
    from opentinker.game import AbstractGame, StepResult

    class Hanging(AbstractGame):
        name = "fragile"

        def get_system_prompt(self):
            return "Two steps."

        def reset(self, *, seed=0):
            return f"Episode {seed}."

        def step(self, action):
            Path(sys.argv[2]).touch()
            time.sleep(600)
            raise AssertionError("killed long before")

    handle = serve(Hanging, envhub_address=sys.argv[1], block=False)
    print("PORT", handle.port, flush=True)
    handle.wait()
    """
)


class TwoSteps(AbstractGame):
    """The survivor: the same env, working; two steps, reward 0.5 each, info on the last."""

    name = ENV_NAME

    def get_system_prompt(self) -> str:
        return "Two steps."

    def reset(self, *, seed: int = 0) -> str:
        self.steps = 0
        return f"Episode {seed}."

    def step(self, action: str) -> StepResult:
        self.steps += 1
        done = self.steps == 2
        return StepResult("Again.", 0.5, done, {"outcome": "win"} if done else {})


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TransformersEngine:
    return tiny_engine(tmp_path_factory)


@contextlib.asynccontextmanager
async def hub_with_doomed_instance(
    marker: Path, *, survivor: bool
) -> AsyncIterator[tuple[str, EnvHubDeps, subprocess.Popen[bytes]]]:
    settings = EnvHubSettings(port=0, builtin_envs=[], env_call_timeout_s=8.0)
    deps = EnvHubDeps.create(settings)
    hub, port = await create_envhub(settings, deps)
    address = f"127.0.0.1:{port}"
    doomed = subprocess.Popen([sys.executable, "-c", DOOMED_SERVER, address, str(marker)])
    alive: EnvServerHandle | None = None
    try:
        if survivor:
            alive = await asyncio.to_thread(serve, TwoSteps, envhub_address=address, block=False)
        wanted = 1 + survivor
        deadline = time.monotonic() + 20
        while len(deps.registry.instances(ENV_NAME)) < wanted:
            assert doomed.poll() is None, "the doomed env server exited early"
            assert time.monotonic() < deadline, "the doomed env server never registered"
            await asyncio.sleep(0.05)
        yield address, deps, doomed
    finally:
        if doomed.poll() is None:
            os.kill(doomed.pid, signal.SIGKILL)
        doomed.wait(timeout=10)
        if alive is not None:
            await asyncio.to_thread(alive.stop, 0)
        await hub.stop(0)
        await deps.close()


async def open_session(address: str, engine: TransformersEngine) -> RolloutSession:
    return await open_two_turn_session(
        address, engine, env_name=ENV_NAME, job_id="job-f", max_episode_retries=2
    )


async def kill_when_stepping(doomed: subprocess.Popen[bytes], marker: Path) -> float:
    """SIGKILL the doomed server as soon as one of its episodes is inside ``step``."""
    deadline = time.monotonic() + 30
    while not marker.exists():
        assert time.monotonic() < deadline, "no episode ever reached the doomed instance's step"
        await asyncio.sleep(0.02)
    os.kill(doomed.pid, signal.SIGKILL)
    return time.monotonic()


def test_a_killed_instance_mid_episode_fails_over_to_the_survivor(
    engine: TransformersEngine, tmp_path: Path
) -> None:
    async def scenario() -> None:
        marker = tmp_path / "stepping"
        async with hub_with_doomed_instance(marker, survivor=True) as (address, deps, doomed):
            session = await open_session(address, engine)
            collect = asyncio.create_task(session.collect(0, num_groups=2, group_size=2))
            killed_at = await kill_when_stepping(doomed, marker)
            batch = await asyncio.wait_for(collect, 30)
            assert time.monotonic() - killed_at < 10, "failover took too long"

            assert len(batch.trajectories) == 4
            for t in batch.trajectories:
                assert t.finish_reason is FinishReason.ENV_DONE, t.finish_detail
                assert (t.num_turns, t.reward, t.info) == (2, 1.0, {"outcome": "win"})
            retries = [t.env_retries for t in batch.trajectories]
            # Episodes are spread over both instances: those on the dead one were restarted once.
            assert sum(r >= 1 for r in retries) >= 1 and max(retries) == 1
            assert batch.stats.env_retries == sum(retries)
            # The trainer-facing ids stay the same; the restarted prompt is the group's prompt.
            assert [t.episode_id for t in batch.trajectories] == [
                f"job-f-b0-g{g}-s{i}" for g in range(2) for i in range(2)
            ]
            assert_one_prompt_per_group(batch, 2)
            # EnvHub dropped the dead instance; the survivor holds no leftover episodes.
            assert len(deps.registry.instances(ENV_NAME)) == 1

    asyncio.run(asyncio.wait_for(scenario(), 90))


def test_no_instance_left_fails_the_batch_naming_the_env(
    engine: TransformersEngine, tmp_path: Path
) -> None:
    async def scenario() -> None:
        marker = tmp_path / "stepping"
        async with hub_with_doomed_instance(marker, survivor=False) as (address, _, doomed):
            session = await open_session(address, engine)
            collect = asyncio.create_task(session.collect(0, num_groups=1, group_size=2))
            killed_at = await kill_when_stepping(doomed, marker)
            with pytest.raises(EnvBatchFailedError) as caught:
                await asyncio.wait_for(collect, 30)
            assert time.monotonic() - killed_at < 10
            message = str(caught.value)
            assert caught.value.code == "UNAVAILABLE"
            assert f"2 of 2 episodes of environment '{ENV_NAME}'" in message
            # The cause, not the consequence: the dead server, its address, its last error.
            assert f"environment '{ENV_NAME}' has no live instance: its server at" in message
            assert "last error: Step failed: UNAVAILABLE" in message
            assert "on restart 1" in message

    asyncio.run(asyncio.wait_for(scenario(), 90))


class RestartingEnvOnFirstTurn:
    """The real engine; before its first generation the env server is SIGKILLed and started
    again at the same address (a supervisor's restart): the episodes reset on the old process
    are stepped on the new one, which never heard of them."""

    def __init__(self, engine: TransformersEngine, restart: Callable[[], None]) -> None:
        self.inner, self._restart = engine, restart
        self.name, self.tokenizer = engine.name, engine.tokenizer

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def generate(self, prompts, sampling, seed):  # noqa: ANN001, ANN201 - pass-through
        if self._restart is not None:
            restart, self._restart = self._restart, None
            restart()
        return self.inner.generate(prompts, sampling, seed)


def test_an_env_server_restarted_between_reset_and_step_restarts_its_episodes(
    engine: TransformersEngine, tmp_path: Path
) -> None:
    """The new process answers the Step NOT_FOUND (it has no such episode): the rollout ended
    the episode with ENV_ERROR, losing it, where a few seconds' more downtime (UNAVAILABLE)
    would have restarted it from Reset. The env lost the episode either way: it restarts."""

    async def scenario() -> None:
        settings = EnvHubSettings(port=0, builtin_envs=[], env_call_timeout_s=8.0)
        deps = EnvHubDeps.create(settings)
        hub, hub_port = await create_envhub(settings, deps)
        address = f"127.0.0.1:{hub_port}"
        crashing = subprocess.Popen(  # killed before any step reaches it
            [sys.executable, "-c", DOOMED_SERVER, address, str(tmp_path / "stepping")],
            stdout=subprocess.PIPE,
        )
        assert crashing.stdout is not None
        line = b""
        while not line.startswith(b"PORT "):  # its logs go to stdout too
            line = await asyncio.to_thread(crashing.stdout.readline)
            assert line, "the env server exited before serving"
        port = int(line.split()[1])
        replaced: list[EnvServerHandle] = []

        def restart() -> None:
            os.kill(crashing.pid, signal.SIGKILL)
            crashing.wait(timeout=10)
            replaced.append(serve(TwoSteps, envhub_address=address, port=port, block=False))

        try:
            session = await open_two_turn_session(
                address,
                RestartingEnvOnFirstTurn(engine, restart),  # type: ignore[arg-type]
                env_name=ENV_NAME,
                job_id="job-r",
                max_episode_retries=2,
            )
            batch = await asyncio.wait_for(session.collect(0, num_groups=1, group_size=2), 60)
            for t in batch.trajectories:
                assert t.finish_reason is FinishReason.ENV_DONE, t.finish_detail
                assert (t.num_turns, t.env_retries) == (2, 1)
            await session.close()
        finally:
            if crashing.poll() is None:
                os.kill(crashing.pid, signal.SIGKILL)
            crashing.wait(timeout=10)
            for handle in replaced:
                await asyncio.to_thread(handle.stop, 0)
            await hub.stop(0)
            await deps.close()

    asyncio.run(asyncio.wait_for(scenario(), 90))
