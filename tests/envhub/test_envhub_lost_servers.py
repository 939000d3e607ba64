"""EnvHub when an env server goes away or stops answering: stopped without deregistering,
killed mid-step, silent instances, a stream cut mid-Reset; and a live server whose game
reports its own backend unavailable, which stays registered. Each fails the episode it
concerns, naming why, and no other. What the env replies and how long it takes:
test_envhub_faults.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest
from envhub_helpers import Episodes, SlowGame, envhub, run

from opentinker.env_auth import new_env_token
from opentinker.envhub.v1 import envhub_pb2 as hub_pb
from opentinker.envhub.v1 import environment_pb2_grpc
from opentinker.errors import UnavailableError
from opentinker.game import AbstractGame, StepResult
from opentinker.services.envhub.games.letter_env import LetterGame


@pytest.mark.integration
def test_a_stopped_env_server_fails_its_episodes_naming_it() -> None:
    async def scenario() -> None:
        async with envhub(env_return_grace_s=0.5) as hub:
            handle = await hub.serve(LetterGame, name="letters")
            episodes = Episodes(hub)
            await episodes.open("letters")
            await episodes.reset("e")
            await episodes.recv()
            handle.server.stop(0).wait()  # gone without deregistering, as after a crash
            started = time.monotonic()
            await episodes.step("e", "A")
            failed = (await episodes.recv()).failed
            assert time.monotonic() - started < 5
            assert failed.code == "UNAVAILABLE"
            assert "'letters'" in failed.reason and handle.address in failed.reason
            assert await hub.instances("letters") == []  # the dead instance was dropped
            # Nothing left to route to after a grace period (short: this server's renewals,
            # still running in this process, would register it again within 2 s).
            await episodes.reset("e2")
            failed = (await episodes.recv()).failed
            assert failed.code == "NOT_FOUND", failed.reason
            # The cause, not the consequence: the dead server, its address, its last error.
            assert f"its server at {handle.address} died" in failed.reason
            assert "last error: Step failed: UNAVAILABLE" in failed.reason
            await asyncio.to_thread(handle.stop, 0)

    run(scenario())


class BackendBlip(AbstractGame):
    """A live server whose game reports its own backend unavailable on action 'blip'."""

    name = "blip"

    def get_system_prompt(self) -> str:
        return ""

    def reset(self, *, seed: int = 0) -> str:
        return "go"

    def step(self, action: str) -> StepResult:
        if action == "blip":
            raise UnavailableError("the game's backend blinked")
        return StepResult(observation="ok", reward=0.0, done=False)


@pytest.mark.integration
def test_a_game_reporting_its_backend_unavailable_keeps_its_live_server_registered() -> None:
    """EnvHub dropped every instance that failed a call UNAVAILABLE, also a live server whose
    game raised UnavailableError: the next Reset (the failed episode's restart too) failed
    NOT_FOUND, and once the server registered again EnvHub counted none of the episodes still
    on it, routing past its capacity. Only an instance that no longer answers is dropped."""

    async def scenario() -> None:
        async with envhub(capacity_wait_s=0) as hub:
            handle = await hub.serve(BackendBlip, capacity=2)
            try:
                [before] = await hub.instances("blip")
                episodes = Episodes(hub)
                await episodes.open("blip")
                for episode_id in ("e1", "e2"):
                    await episodes.reset(episode_id)
                    assert (await episodes.recv()).reset.episode_id == episode_id
                await episodes.step("e1", "blip")
                failed = (await episodes.recv()).failed
                assert (failed.episode_id, failed.code) == ("e1", "UNAVAILABLE")
                assert "the game's backend blinked" in failed.reason
                await episodes.reset("e1-r1")  # the rollout's restart of e1
                assert (await episodes.recv()).reset.episode_id == "e1-r1"
                [after] = await hub.instances("blip")
                assert after.instance_id == before.instance_id
                assert after.active_episodes == 2 == len(handle.table)  # e2 and e1-r1
                await episodes.reset("e3")  # at capacity: EnvHub says so, the env never sees it
                refused = (await episodes.recv()).failed
                assert refused.code == "RESOURCE_EXHAUSTED" and "at capacity" in refused.reason
            finally:
                await asyncio.to_thread(handle.stop, 0)

    run(scenario())


class SilentEnvironment(environment_pb2_grpc.EnvironmentServiceServicer):
    """An env server that accepts calls and never answers them (deadlocked, say)."""

    async def GetEnvironmentSpec(self, request, context):  # noqa: N802 - gRPC method name
        await asyncio.sleep(3600)


@pytest.mark.integration
def test_silent_instances_do_not_keep_a_stream_from_opening_on_a_live_one() -> None:
    """EnvHub asked the instances for the env's spec one after another, least loaded first,
    each with the full env call deadline: two silent instances ahead of the live one (busy,
    so it sorts last) held an OpenEpisodes 2 x 10 s, past the rollout's own 15 s wait, so the
    rollout could not open the env at all while a live instance served it."""

    async def scenario() -> None:
        silent = grpc.aio.server()
        environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(SilentEnvironment(), silent)
        ports = [silent.add_insecure_port("127.0.0.1:0") for _ in range(2)]
        await silent.start()
        async with envhub() as hub:
            live = await hub.serve(SlowGame, capacity=1)
            try:
                busy = Episodes(hub)
                await busy.open("slow")
                await busy.reset("held")  # the live instance is full: it sorts last by load
                assert (await busy.recv()).reset.episode_id == "held"
                for port in ports:
                    await hub.stub.RegisterEnvironment(
                        hub_pb.RegisterEnvironmentRequest(
                            env_name="slow",
                            address=f"127.0.0.1:{port}",
                            capacity=0,
                            env_token=new_env_token(),
                        ),
                        timeout=5,
                    )
                episodes = Episodes(hub)
                spec = await episodes.open("slow")  # waits at most 5 s for the reply
                assert spec.name == "slow"
            finally:
                await asyncio.to_thread(live.stop, 0)
                await silent.stop(0)

    run(scenario())


class SlowReset(AbstractGame):
    """Reset takes a second (its game is built, then set up)."""

    name = "slow-reset"

    def get_system_prompt(self) -> str:
        return ""

    def reset(self, *, seed: int = 0) -> str:
        time.sleep(1.0)
        return "go"

    def step(self, action: str) -> StepResult:
        return StepResult(observation="ok", reward=0.0, done=True)


@pytest.mark.integration
def test_a_stream_that_ends_mid_reset_leaves_no_episode_on_the_env_server() -> None:
    """A rollout that died (or cut its stream) while a Reset was at the env: EnvHub cancelled
    the call and closed the episode at once, before the env had opened it; the env finished
    the Reset anyway, and the game stayed open there, holding one of the env's slots (which
    EnvHub counted free) until the env reaped it as idle, ten minutes later by default."""

    async def scenario() -> None:
        async with envhub() as hub:
            handle = await hub.serve(SlowReset, capacity=4)
            try:
                episodes = Episodes(hub)
                await episodes.open("slow-reset")
                await episodes.reset("e1")
                await asyncio.sleep(0.3)  # the env is inside reset()
                episodes.call.cancel()
                await asyncio.sleep(1.0)  # the env's reset() is over
                for _ in range(100):
                    if len(handle.table) == 0:
                        break
                    await asyncio.sleep(0.05)
                assert len(handle.table) == 0, "the env still holds the episode"
                [instance] = await hub.instances("slow-reset")
                assert instance.active_episodes == 0
            finally:
                await asyncio.to_thread(handle.stop, 0)

    run(scenario())


KILLABLE_ENV = textwrap.dedent(
    """
    import sys, time
    from opentinker.env_server import serve
    from opentinker.game import AbstractGame, StepResult

    class Sleeper(AbstractGame):
        def get_system_prompt(self): return ""
        def reset(self, *, seed=0): return "go"
        def step(self, action):
            time.sleep(60)
            return StepResult(observation="", reward=0.0, done=True)

    serve(Sleeper, name="sleeper", envhub_address=sys.argv[1])
    """
)


@pytest.mark.integration
def test_a_killed_env_server_mid_step_fails_the_episode_within_seconds(tmp_path: Path) -> None:
    script = tmp_path / "sleeper_env.py"
    script.write_text(KILLABLE_ENV)

    async def scenario() -> None:
        async with envhub() as hub:
            process = subprocess.Popen([sys.executable, str(script), hub.address])
            try:
                for _ in range(600):
                    if await hub.instances("sleeper"):
                        break
                    assert process.poll() is None, "the env server process exited"
                    await asyncio.sleep(0.05)
                episodes = Episodes(hub)
                await episodes.open("sleeper")
                await episodes.reset("e")
                await episodes.recv()
                await episodes.step("e", "anything")  # sleeps 60 s inside the game
                await asyncio.sleep(0.3)
                process.kill()
                started = time.monotonic()
                failed = (await episodes.recv(timeout_s=5)).failed
                assert time.monotonic() - started < 5
                assert failed.episode_id == "e" and failed.code == "UNAVAILABLE"
                assert "'sleeper'" in failed.reason
            finally:
                process.kill()
                process.wait(timeout=10)

    run(scenario())
