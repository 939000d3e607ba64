"""EnvHub itself going away mid-batch: a real EnvHub server (in-process) is stopped while the
rollout's episodes wait in ``step`` on a real env server, and started again on the same port.
The rollout reconnects, the env server registers again, and the lost episodes start over from
Reset with the same seeds, without using the env failover budget. When EnvHub never comes back,
the batch fails within the reconnect bound, naming EnvHub and its address."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

import pytest
from envhub_helpers import RestartableHub
from rollout_helpers import assert_one_prompt_per_group, open_two_turn_session, tiny_engine

from opentinker.env_server import serve
from opentinker.game import AbstractGame, StepResult
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.envs.envhub_link import EnvHubUnreachableError
from opentinker.services.rollout.session import RolloutSession
from opentinker.services.rollout.types import FinishReason

pytestmark = pytest.mark.integration

ENV_NAME = "gated"


class Gate:
    """Holds the first steps inside the env server until the test opens it."""

    def __init__(self) -> None:
        self.stepping = threading.Event()  # set when a step waits at the gate
        self.opened = threading.Event()
        self.resets: list[int] = []  # seeds of every reset the env server played
        self.lock = threading.Lock()


GATE = Gate()


class Gated(AbstractGame):
    """Two steps, reward 0.5 each; every step waits until the gate is opened."""

    name = ENV_NAME

    def get_system_prompt(self) -> str:
        return "Two steps."

    def reset(self, *, seed: int = 0) -> str:
        with GATE.lock:
            GATE.resets.append(seed)
        self.steps = 0
        return f"Episode {seed}."

    def step(self, action: str) -> StepResult:
        GATE.stepping.set()
        GATE.opened.wait(timeout=60)
        self.steps += 1
        return StepResult("Again.", 0.5, self.steps == 2, {})


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TransformersEngine:
    return tiny_engine(tmp_path_factory)


@contextlib.asynccontextmanager
async def hub_and_env() -> AsyncIterator[RestartableHub]:
    global GATE
    GATE = Gate()
    hub = RestartableHub()
    await hub.start()
    env = await asyncio.to_thread(serve, Gated, envhub_address=hub.address, block=False)
    try:
        yield hub
    finally:
        GATE.opened.set()
        await asyncio.to_thread(env.stop, 0)
        await hub.stop()


async def open_session(
    address: str, engine: TransformersEngine, reconnect_s: float
) -> RolloutSession:
    return await open_two_turn_session(
        address,
        engine,
        env_name=ENV_NAME,
        job_id="job-r",
        max_episode_retries=1,
        envhub_reconnect_s=reconnect_s,
    )


async def wait_for(event: threading.Event, what: str) -> None:
    if not await asyncio.to_thread(event.wait, 30):
        raise AssertionError(f"never happened: {what}")


def test_a_batch_rides_out_envhub_stopped_and_started_again(engine: TransformersEngine) -> None:
    async def scenario() -> None:
        async with hub_and_env() as hub:
            session = await open_session(hub.address, engine, reconnect_s=30)
            collect = asyncio.create_task(session.collect(0, num_groups=2, group_size=2))
            await wait_for(GATE.stepping, "an episode reached step")
            first_resets = list(GATE.resets)
            await hub.stop()  # every episode of the batch is lost with EnvHub's routes
            stopped = time.monotonic()
            await asyncio.sleep(1.0)
            assert not collect.done(), "the batch must wait for EnvHub, not fail"
            GATE.opened.set()
            await hub.start()  # same port; empty registry until the env server registers again
            batch = await asyncio.wait_for(collect, 60)
            paused_s = time.monotonic() - stopped

            assert len(batch.trajectories) == 4
            for t in batch.trajectories:
                assert t.finish_reason is FinishReason.ENV_DONE, t.finish_detail
                assert (t.num_turns, t.reward) == (2, 1.0)
                assert t.env_retries == 0, "losing EnvHub is not the env's failure"
            assert batch.stats.env_retries == 0
            # Same trainer-facing episodes, restarted from Reset with the group's seeds.
            assert [t.episode_id for t in batch.trajectories] == [
                f"job-r-b0-g{g}-s{i}" for g in range(2) for i in range(2)
            ]
            assert len(first_resets) == 4 and len(GATE.resets) == 8
            assert sorted(GATE.resets[4:]) == sorted(first_resets)
            assert_one_prompt_per_group(batch, 2)
            # The env server registered itself again with the new EnvHub.
            assert hub.instances(ENV_NAME) == 1
            assert paused_s < 30

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_a_batch_that_starts_while_envhub_is_away_waits_for_it(engine: TransformersEngine) -> None:
    async def scenario() -> None:
        async with hub_and_env() as hub:
            GATE.opened.set()  # nothing is held: EnvHub is away between batches
            session = await open_session(hub.address, engine, reconnect_s=30)
            await hub.stop()
            collect = asyncio.create_task(session.collect(1, num_groups=1, group_size=2))
            await asyncio.sleep(1.0)
            assert not collect.done(), "the batch must wait for EnvHub, not fail"
            await hub.start()
            batch = await asyncio.wait_for(collect, 60)
            assert [(t.finish_reason, t.env_retries) for t in batch.trajectories] == [
                (FinishReason.ENV_DONE, 0)
            ] * 2
            assert len(GATE.resets) == 2  # nothing was lost: the batch began after EnvHub was back
            assert hub.instances(ENV_NAME) == 1

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_envhub_gone_for_longer_than_the_bound_fails_the_batch_naming_it(
    engine: TransformersEngine,
) -> None:
    reconnect_s = 3.0

    async def scenario() -> None:
        async with hub_and_env() as hub:
            session = await open_session(hub.address, engine, reconnect_s=reconnect_s)
            collect = asyncio.create_task(session.collect(0, num_groups=1, group_size=2))
            await wait_for(GATE.stepping, "an episode reached step")
            stopping = time.monotonic()  # the link notices the loss after this
            await hub.stop()  # and never started again
            with pytest.raises(EnvHubUnreachableError) as caught:
                await asyncio.wait_for(collect, 60)
            waited_s = time.monotonic() - stopping
            message = str(caught.value)
            assert caught.value.code == "UNAVAILABLE"
            assert f"EnvHub at {hub.address}" in message
            assert f"environment '{ENV_NAME}' again) within 3 s" in message
            assert "OPENTINKER_ROLLOUT_ENVHUB_RECONNECT_S" in message
            # It tried for the whole bound, and gave up soon after it.
            assert reconnect_s <= waited_s < reconnect_s + 10

    asyncio.run(asyncio.wait_for(scenario(), 120))
