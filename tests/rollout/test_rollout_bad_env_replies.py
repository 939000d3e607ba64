"""Bad env replies through real gRPC end only their episode, with a recorded reason.

Two envs behind a real EnvHub: ``raw``, a hand-written ``EnvironmentService`` that checks
nothing (as an env in another language might), and ``sloppy``, an SDK game whose step raises
or returns a result with missing fields. The episode id picks the misbehaviour.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from identity_helpers import user_channel, user_key
from rollout_helpers import tiny_engine

from opentinker.env_auth import new_env_token
from opentinker.env_server import serve
from opentinker.envhub.v1 import envhub_pb2, envhub_pb2_grpc, environment_pb2, environment_pb2_grpc
from opentinker.game import AbstractGame, StepResult
from opentinker.services.envhub.server import EnvHubDeps
from opentinker.services.envhub.server import create_server as create_envhub
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.rollout.agent.agent_loop import AgentLoop
from opentinker.services.rollout.agent.loop_config import EpisodeRequest, LoopConfig
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.envs.envhub_client import EnvHubClient
from opentinker.services.rollout.types import FinishReason, Trajectory
from opentinker.spec import SamplingParams

pytestmark = pytest.mark.integration

LIMIT = 16384  # RolloutSettings.max_observation_chars' default


def caller_id(episode_id: str) -> str:
    """The rollout's episode id: EnvHub sends it under its stream's prefix ("<stream>/<id>")."""
    return episode_id.rpartition("/")[2]


class RawEnv(environment_pb2_grpc.EnvironmentServiceServicer):
    """An env with no SDK and no checks; misbehaves as its episode id's prefix says."""

    async def GetEnvironmentSpec(self, request, context):  # noqa: N802
        return environment_pb2.GetEnvironmentSpecResponse(
            spec=environment_pb2.EnvironmentSpec(name="raw")
        )

    async def Reset(self, request, context):  # noqa: N802
        if caller_id(request.episode_id).startswith("missing"):
            return environment_pb2.ResetResponse()  # neither system prompt nor observation
        return environment_pb2.ResetResponse(system_prompt="Say anything.", observation="Go.")

    async def Step(self, request, context):  # noqa: N802
        kind = caller_id(request.episode_id).split("-")[0]
        if kind == "raise":
            raise RuntimeError("the raw env fell over")
        reward = {"nan": math.nan, "inf": math.inf}.get(kind, 1.0)
        observation = "x" * (LIMIT + 1) if kind == "huge" else "Next."
        return environment_pb2.StepResponse(
            observation=observation, reward=reward, done=kind != "huge", info={"kind": kind}
        )

    async def CloseEpisode(self, request, context):  # noqa: N802
        return environment_pb2.CloseEpisodeResponse()


class Sloppy(AbstractGame):
    name = "sloppy"

    def get_system_prompt(self) -> str:
        return "Say anything."

    def reset(self, *, seed: int = 0) -> str:
        self.kind = ["ok", "raise", "dict"][seed]
        return "Go."

    def step(self, action: str) -> StepResult:
        if self.kind == "raise":
            raise ZeroDivisionError("division by zero inside step")
        if self.kind == "dict":
            return {"reward": 1.0}  # type: ignore[return-value]  # observation, done missing
        return StepResult("", 1.0, True, {"outcome": "win"})


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TransformersEngine:
    return tiny_engine(tmp_path_factory)


async def play(
    engine: TransformersEngine, address: str, env_name: str, episodes: list[tuple[str, int]]
) -> list[Trajectory]:
    config = LoopConfig(
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4),
        max_turns=2,
        max_episode_tokens=256,
    )
    async with EnvHubClient(
        address, credential=user_key(), job_id="j", env_name=env_name, timeout_s=10
    ) as client:
        requests = [
            EpisodeRequest(eid, n, seed, client.session(eid), client.session)
            for n, (eid, seed) in enumerate(episodes)
        ]
        trajectories, _ = await AgentLoop(engine, config).run(requests, seed=0)
    return trajectories


def test_bad_replies_end_their_episode_with_a_reason_and_the_rest_go_on(
    engine: TransformersEngine,
) -> None:
    async def scenario() -> None:
        # EnvHub's own observation limit (where it has one) is lifted: the rollout's is tested.
        settings = EnvHubSettings.model_validate(
            {
                "port": 0,
                "builtin_envs": [],
                "env_call_timeout_s": 5.0,
                "max_observation_chars": 10 * LIMIT,
            }
        )
        deps = EnvHubDeps.create(settings)
        hub, hub_port = await create_envhub(settings, deps)
        address = f"127.0.0.1:{hub_port}"
        raw = grpc.aio.server()
        environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(RawEnv(), raw)
        raw_port = raw.add_insecure_port("127.0.0.1:0")
        await raw.start()
        sloppy = await asyncio.to_thread(serve, Sloppy, envhub_address=address, block=False)
        channel = user_channel(address)
        try:
            await envhub_pb2_grpc.EnvHubServiceStub(channel).RegisterEnvironment(
                envhub_pb2.RegisterEnvironmentRequest(
                    env_name="raw",
                    address=f"127.0.0.1:{raw_port}",
                    capacity=0,
                    env_token=new_env_token(),  # this hand-made server checks none
                ),
                timeout=5,
            )
            ids = ["ok-0", "nan-1", "inf-2", "huge-3", "raise-4", "missing-5", "ok-6"]
            raw_runs = await play(engine, address, "raw", [(eid, 0) for eid in ids])
            by_id = {t.episode_id: t for t in raw_runs}
            sdk_runs = await play(engine, address, "sloppy", [("a", 0), ("b", 1), ("c", 2)])
        finally:
            await channel.close()
            await asyncio.to_thread(sloppy.stop, 0)
            await raw.stop(0)
            await hub.stop(0)
            await deps.close()

        for eid in ("ok-0", "ok-6"):
            t = by_id[eid]
            assert (t.finish_reason, t.reward, t.info) == (
                FinishReason.ENV_DONE,
                1.0,
                {"kind": "ok"},
            )
        bad = {eid: by_id[eid] for eid in ids if not eid.startswith("ok")}
        for t in bad.values():
            assert t.finish_reason is FinishReason.ENV_ERROR, t.episode_id
            assert t.env_retries == 0 and t.reward == 0.0 and t.finish_detail
        assert "non-finite reward (nan)" in bad["nan-1"].finish_detail
        assert "non-finite reward (inf)" in bad["inf-2"].finish_detail
        assert "'raw'" in bad["nan-1"].finish_detail  # EnvHub names the env and instance
        assert f"{LIMIT + 1} characters" in bad["huge-3"].finish_detail
        assert f"max_observation_chars={LIMIT}" in bad["huge-3"].finish_detail
        assert "the raw env fell over" in bad["raise-4"].finish_detail
        assert "missing fields" in bad["missing-5"].finish_detail
        assert bad["missing-5"].num_turns == 0

        ok, raised, partial = sdk_runs
        assert (ok.finish_reason, ok.info) == (FinishReason.ENV_DONE, {"outcome": "win"})
        assert raised.finish_reason is FinishReason.ENV_ERROR
        assert "ZeroDivisionError: division by zero inside step" in raised.finish_detail
        assert partial.finish_reason is FinishReason.ENV_ERROR
        assert "step returned dict, not StepResult" in partial.finish_detail

    asyncio.run(asyncio.wait_for(scenario(), 60))
