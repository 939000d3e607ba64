"""Once a training batch is played, the rollout resets the next batch's episodes while the
trainer trains (batch_ahead.py): the request for that batch finds them ready and resets
nothing, plays exactly the episodes a fresh request would (same ids, same seeds, same
prompts), and a request of another batch closes them. Real EnvHub, real env server, tiny
model."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

import pytest
from rollout_helpers import open_two_turn_session, tiny_engine

from opentinker.env_server import EnvServerHandle, serve
from opentinker.game import AbstractGame, StepResult
from opentinker.services.envhub.server import EnvHubDeps
from opentinker.services.envhub.server import create_server as create_envhub
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.engines.multi_lora import SharedLoraEngine
from opentinker.services.rollout.shared.batcher import MixedBatcher
from opentinker.services.rollout.shared.shared_engine import SharedAdapters
from opentinker.services.rollout.types import TrajectoryBatch
from opentinker.spec import LoraConfig, ModelSpec

pytestmark = pytest.mark.integration

RESETS: list[int] = []  # the seed of every reset the env server played
LOCK = threading.Lock()


class Counted(AbstractGame):
    """One step, reward 1; every reset is recorded."""

    name = "counted"

    def get_system_prompt(self) -> str:
        return "One step."

    def reset(self, *, seed: int = 0) -> str:
        with LOCK:
            RESETS.append(seed)
        return f"Episode {seed}."

    def step(self, action: str) -> StepResult:
        return StepResult("", 1.0, True, {})


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TransformersEngine:
    return tiny_engine(tmp_path_factory)


@contextlib.asynccontextmanager
async def hub_with_env(
    *, capacity: int = 64, capacity_wait_s: float = 10.0
) -> AsyncIterator[tuple[str, EnvServerHandle]]:
    settings = EnvHubSettings(port=0, builtin_envs=[], capacity_wait_s=capacity_wait_s)
    deps = EnvHubDeps.create(settings)
    server, port = await create_envhub(settings, deps)
    address = f"127.0.0.1:{port}"
    env = await asyncio.to_thread(
        serve, Counted, envhub_address=address, block=False, capacity=capacity
    )
    try:
        yield address, env
    finally:
        await asyncio.to_thread(env.stop, 0)
        await server.stop(0)
        await deps.close()


def resets() -> int:
    with LOCK:
        return len(RESETS)


async def until(condition, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.01)


def prompts(batch: TrajectoryBatch) -> list[tuple[str, tuple[int, ...]]]:
    return [(t.episode_id, tuple(t.token_ids[: t.prompt_length])) for t in batch.trajectories]


def test_the_next_batch_is_reset_while_the_trainer_trains(engine: TransformersEngine) -> None:
    async def scenario() -> None:
        RESETS.clear()
        async with hub_with_env() as (address, env):
            session = await open_two_turn_session(
                address, engine, env_name="counted", job_id="job-a"
            )
            assert engine.prefixes is not None, "two turns: a turn continues the one before"
            await session.collect(0, num_groups=2, group_size=3)
            # Batch 1's six episodes are reset before anyone asks for batch 1.
            await until(lambda: resets() == 12 and len(env.table) == 6, "batch 1 reset ahead")
            batch_1 = await session.collect(1, num_groups=2, group_size=3)
            assert resets() == 12, "the request found batch 1 reset: it reset nothing itself"
            assert [t.reward for t in batch_1.trajectories] == [1.0] * 6

            # The same batch requested of a rollout that does not reset ahead: the very same
            # episodes (ids, group seeds, prompts).
            plain = await open_two_turn_session(
                address, engine, env_name="counted", job_id="job-a", reset_ahead=False
            )
            assert prompts(await plain.collect(1, num_groups=2, group_size=3)) == prompts(batch_1)
            await plain.close()

            # A request for another batch closes batch 2's episodes and plays its own.
            await until(lambda: resets() == 24, "batch 2 reset ahead")
            batch_7 = await session.collect(7, num_groups=1, group_size=2)
            assert [t.episode_id for t in batch_7.trajectories] == [
                "job-a-b7-g0-s0",
                "job-a-b7-g0-s1",
            ]
            assert resets() == 26
            # The stream's end closes batch 8's episodes, reset ahead: nothing stays open.
            await until(lambda: resets() == 28, "batch 8 reset ahead")
            await session.close()
            await until(lambda: len(env.table) == 0, "every episode closed")

    asyncio.run(scenario())


def test_a_batch_larger_than_the_envs_capacity_is_reset_ahead_only_as_far_as_it_fits(
    engine: TransformersEngine,
) -> None:
    """8 episodes a batch, an env of capacity 4: the 4 reset ahead hold every slot until
    played, so the other 4 find the env full. They are not failed: they are reset when played
    (as the played ones free their slots), and from then on only 4 are reset ahead."""

    async def scenario() -> None:
        async with hub_with_env(capacity=4, capacity_wait_s=3.0) as (address, _env):
            session = await open_two_turn_session(
                address, engine, env_name="counted", job_id="job-c"
            )
            for batch_index in range(3):
                batch = await session.collect(batch_index, num_groups=2, group_size=4)
                assert [t.reward for t in batch.trajectories] == [1.0] * 8, batch_index
                assert all(t.finish_reason.name != "ENV_ERROR" for t in batch.trajectories)
            assert session._ahead is not None and session._ahead.limit == 4
            await session.close()

    asyncio.run(scenario())


def test_an_evaluation_finds_env_slots_that_the_batch_reset_ahead_held(
    engine: TransformersEngine,
) -> None:
    """An env of capacity 4, batches of 4: once batch 0 is played, batch 1's episodes are
    reset ahead and hold every slot. A validation asked for then (the trainer validates after
    a step) plays its episodes; before, each waited capacity_wait_s for a slot and ended
    ENV_ERROR (RESOURCE_EXHAUSTED). Batch 1 is reset ahead again and played as usual."""

    async def scenario() -> None:
        async with hub_with_env(capacity=4, capacity_wait_s=1.0) as (address, env):
            session = await open_two_turn_session(
                address, engine, env_name="counted", job_id="job-e"
            )
            RESETS.clear()
            await session.collect(0, num_groups=1, group_size=4)
            await until(lambda: resets() == 8 and len(env.table) == 4, "batch 1 reset ahead")
            val = await session.evaluate(1, 2, first_episode=0, temperature=0.0)
            details = [(t.finish_reason.name, t.finish_detail) for t in val.trajectories]
            assert [t.reward for t in val.trajectories] == [1.0, 1.0], details
            # batch 1 is reset ahead again (4 more resets after the 2 of the evaluation) ...
            await until(lambda: resets() == 14 and len(env.table) == 4, "batch 1 reset again")
            batch = await session.collect(1, num_groups=1, group_size=4)
            assert [t.reward for t in batch.trajectories] == [1.0] * 4
            assert resets() == 14, "... and its request found it reset"
            await session.close()

    asyncio.run(scenario())


def test_a_limited_batch_is_tried_whole_again_and_uses_capacity_registered_later(
    engine: TransformersEngine,
) -> None:
    """8 episodes a batch, an env of capacity 4: the limit of 4 is tried whole again after
    reset_ahead_probe_s, waiting twice as long after a try that still found the env full; once
    a second instance of the env registers, the whole batch fits and the limit goes."""

    async def scenario() -> None:
        async with hub_with_env(capacity=4, capacity_wait_s=1.0) as (address, _env):
            session = await open_two_turn_session(
                address, engine, env_name="counted", job_id="job-d", reset_ahead_probe_s=0.01
            )
            ahead = session._ahead
            assert ahead is not None
            for batch_index in range(3):
                batch = await session.collect(batch_index, num_groups=2, group_size=4)
                assert [t.reward for t in batch.trajectories] == [1.0] * 8, batch_index
            # batch 1 set the limit, batch 2 was a whole try that still did not fit
            assert ahead.limit == 4 and ahead.wait_s == pytest.approx(0.02)
            more = await asyncio.to_thread(
                serve, Counted, envhub_address=address, block=False, capacity=4
            )
            try:
                for batch_index in range(3, 5):
                    batch = await session.collect(batch_index, num_groups=2, group_size=4)
                    assert [t.reward for t in batch.trajectories] == [1.0] * 8, batch_index
                assert ahead.limit is None, "8 slots now: the whole batch is reset ahead again"
                await session.close()
            finally:
                await asyncio.to_thread(more.stop, 0)

    asyncio.run(scenario())


def test_a_multi_turn_job_on_a_shared_engine_keeps_its_prefixes(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The session turns the prefix cache on for its job's adapter on a shared multi-LoRA
    engine as on a private one; another job's adapter there stays off."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-shared"))
    shared = SharedAdapters(MixedBatcher(SharedLoraEngine.load(str(model_dir))), capacity=2)
    lora = ModelSpec(base_model=str(model_dir), finetune="lora", lora=LoraConfig(rank=4))
    mine, other = shared.attach("job-a", lora), shared.attach("job-b", lora)

    async def scenario() -> None:
        async with hub_with_env() as (address, _):
            await open_two_turn_session(address, mine, env_name="counted", job_id="job-a")

    asyncio.run(scenario())
    assert shared.engine.keeps_prefixes(mine.adapter)
    assert not shared.engine.keeps_prefixes(other.adapter)
