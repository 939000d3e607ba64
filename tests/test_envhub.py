"""EnvHub: the registry (unit), and the real service routing episodes to real env servers."""

from __future__ import annotations

import asyncio
import contextlib
import math
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from identity_helpers import user_channel
from pydantic import ValidationError

from opentinker.common.v1 import common_pb2
from opentinker.env_server import EnvServerHandle, serve
from opentinker.envhub.v1 import envhub_pb2 as hub_pb
from opentinker.envhub.v1 import envhub_pb2_grpc, environment_pb2_grpc
from opentinker.envhub.v1 import environment_pb2 as env_pb
from opentinker.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from opentinker.game import AbstractGame, StepResult
from opentinker.services.envhub.games.letter_env import LetterGame
from opentinker.services.envhub.registry import InMemoryRegistry, page
from opentinker.services.envhub.server import EnvHubDeps, create_server
from opentinker.services.envhub.settings import EnvHubSettings

# --------------------------------------------------------------------------------------------
# Registry (unit): a hand-driven clock instead of sleeping.


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.unit
def test_registry_register_renew_expire() -> None:
    clock = Clock()
    registry = InMemoryRegistry(ttl_s=10, clock=clock)
    a = registry.register("letter", "127.0.0.1:1", 4)
    b = registry.register("letter", "127.0.0.1:2", 4)
    builtin = registry.register("letter", "127.0.0.1:3", 4, pinned=True)
    clock.now += 8
    registry.renew(a.instance_id)
    clock.now += 8  # b missed its renewals for 16 s > ttl; a renewed 8 s ago
    assert {i.instance_id for i in registry.instances()} == {a.instance_id, builtin.instance_id}
    with pytest.raises(NotFoundError, match="register again"):
        registry.renew(b.instance_id)
    registry.deregister(a.instance_id)
    registry.deregister("unknown")  # harmless
    assert [i.instance_id for i in registry.instances()] == [builtin.instance_id]


@pytest.mark.unit
def test_registry_same_address_replaces_and_bad_registrations_are_refused() -> None:
    registry = InMemoryRegistry(ttl_s=10, clock=Clock())
    first = registry.register("letter", "127.0.0.1:1", 4)
    second = registry.register("letter", "127.0.0.1:1", 4)
    assert [i.instance_id for i in registry.instances()] == [second.instance_id]
    assert first.instance_id != second.instance_id
    with pytest.raises(InvalidArgumentError) as info:
        registry.register("bad name", "nowhere", -1)
    for words in ("env_name", "address", "capacity"):  # every problem at once
        assert words in str(info.value)


@pytest.mark.unit
def test_registry_routes_to_least_loaded_with_room() -> None:
    registry = InMemoryRegistry(ttl_s=10, clock=Clock())
    small = registry.register("letter", "127.0.0.1:1", 1)
    big = registry.register("letter", "127.0.0.1:2", 3)
    picks = [registry.acquire("letter", tenant="").instance_id for _ in range(4)]
    assert sorted(picks) == sorted([small.instance_id] + [big.instance_id] * 3)
    with pytest.raises(ResourceExhaustedError, match="capacity"):
        registry.acquire("letter", tenant="")
    registry.release(small.instance_id)
    assert registry.acquire("letter", tenant="").instance_id == small.instance_id
    with pytest.raises(NotFoundError, match=r"'chess'.*registered: \['letter'\]"):
        registry.acquire("chess", tenant="")


@pytest.mark.unit
def test_a_tenants_own_env_shadows_a_shared_one_of_the_same_name_and_never_mixes() -> None:
    registry = InMemoryRegistry(ttl_s=10, clock=Clock())
    shared = registry.register("echo", "127.0.0.1:1", 0, shared=True)
    acme = registry.register("echo", "127.0.0.1:2", 0, tenant_id="acme")
    globex = registry.register("echo", "127.0.0.1:3", 0, tenant_id="globex")
    # Each tenant is routed to its own registration only; a tenant without one to the shared.
    assert {registry.acquire("echo", tenant="acme").instance_id for _ in range(5)} == {
        acme.instance_id
    }
    assert registry.routable("echo", tenant="globex") == [globex]
    assert registry.routable("echo", tenant="initech") == [shared]
    # An admin's episodes are routed by the admin's own tenant too, never into another's env.
    assert registry.routable("echo", tenant="system") == [shared]
    # Listing is wider than routing: an admin sees every registration.
    assert len(registry.instances("echo")) == 3


@pytest.mark.unit
def test_pagination_walks_every_instance_once() -> None:
    registry = InMemoryRegistry(ttl_s=10, clock=Clock())
    for n in range(7):
        registry.register(f"env{n % 3}", f"127.0.0.1:{n + 1}", 0)
    seen, token = [], ""
    while True:
        batch, token = page(registry.instances(), page_size=3, page_token=token)
        seen += [i.instance_id for i in batch]
        if not token:
            break
    assert seen == [i.instance_id for i in registry.instances()]
    with pytest.raises(InvalidArgumentError, match="page_token"):
        page(registry.instances(), page_size=3, page_token="garbage")


@pytest.mark.unit
def test_settings_are_checked_together() -> None:
    with pytest.raises(ValidationError) as info:
        EnvHubSettings(renew_interval_s=5, registration_ttl_s=5, builtin_envs=["chess"])
    assert "registration_ttl_s" in str(info.value) and "chess" in str(info.value)
    assert EnvHubSettings().port == 50052


# --------------------------------------------------------------------------------------------
# The real service. Each test runs one asyncio loop that hosts EnvHub; env servers (threads)
# are started with asyncio.to_thread, since they register with EnvHub by blocking calls.


class SlowGame(AbstractGame):
    """Step sleeps for the number of seconds in the action ('0.0' is instant)."""

    name = "slow"

    def get_system_prompt(self) -> str:
        return ""

    def reset(self, *, seed: int = 0) -> str:
        return "go"

    def step(self, action: str) -> StepResult:
        if action == "boom":
            raise RuntimeError("out of cheese")
        time.sleep(float(action))
        return StepResult(observation="ok", reward=float(action), done=False)


@dataclass
class Hub:
    address: str
    deps: EnvHubDeps
    stub: envhub_pb2_grpc.EnvHubServiceStub

    async def serve(self, game: type[AbstractGame], **options: Any) -> EnvServerHandle:
        return await asyncio.to_thread(
            serve, game, envhub_address=self.address, block=False, **options
        )

    async def instances(self, env_name: str = "") -> list[hub_pb.EnvironmentInstance]:
        reply = await self.stub.ListEnvironments(hub_pb.ListEnvironmentsRequest(), timeout=5)
        return [i for i in reply.instances if not env_name or i.env_name == env_name]


@contextlib.asynccontextmanager
async def envhub(**settings: object) -> AsyncIterator[Hub]:
    config = EnvHubSettings(port=0, **{"builtin_envs": [], **settings})  # type: ignore[arg-type]
    deps = EnvHubDeps.create(config)
    server, port = await create_server(config, deps)
    address = f"127.0.0.1:{port}"
    async with user_channel(address) as channel:
        try:
            yield Hub(address, deps, envhub_pb2_grpc.EnvHubServiceStub(channel))
        finally:
            await server.stop(0)
            await deps.close()


class Episodes:
    """A RunEpisodes stream driven by plain awaits."""

    def __init__(self, hub: Hub) -> None:
        self.call = hub.stub.RunEpisodes(timeout=60)
        self.seq = 0

    async def send(self, **payload: Any) -> None:
        self.seq += 1
        await self.call.write(hub_pb.RunEpisodesRequest(seq=self.seq, **payload))

    async def recv(self, timeout_s: float = 5.0) -> hub_pb.RunEpisodesResponse:
        reply = await asyncio.wait_for(self.call.read(), timeout_s)
        assert reply is not grpc.aio.EOF, "the stream ended"
        return reply

    async def open(self, env_name: str) -> env_pb.EnvironmentSpec:
        await self.send(open=hub_pb.OpenEpisodes(job_id="job-1", env_name=env_name))
        return (await self.recv()).opened.spec

    async def reset(self, episode_id: str, seed: int = 0, **options: str) -> None:
        await self.send(
            reset=env_pb.ResetRequest(episode_id=episode_id, seed=seed, options=options)
        )

    async def step(self, episode_id: str, action: str) -> None:
        await self.send(step=env_pb.StepRequest(episode_id=episode_id, action=action))


def run(coro) -> None:  # noqa: ANN001 - a coroutine
    asyncio.run(asyncio.wait_for(coro, 60))


@pytest.mark.integration
def test_builtin_letter_episode_through_envhub() -> None:
    async def scenario() -> None:
        async with envhub(builtin_envs=["letter"]) as hub:
            episodes = Episodes(hub)
            spec = await episodes.open("letter")
            assert (spec.name, spec.max_turns) == ("letter", 1)
            await episodes.reset("e1", seed=4, num_letters="8")
            reset = (await episodes.recv()).reset
            assert reset.episode_id == "e1"
            target = reset.result.observation.removeprefix("Answer with the letter ")[0]
            assert target in "ABCDEFGH" and "capital letter" in reset.result.system_prompt
            await episodes.step("e1", target)
            stepped = (await episodes.recv()).stepped
            assert (stepped.episode_id, stepped.result.reward, stepped.result.done) == (
                "e1",
                1.0,
                True,
            )
            await episodes.step("never-reset", "A")
            failed = (await episodes.recv()).failed
            assert (failed.episode_id, failed.code) == ("never-reset", "NOT_FOUND")
            await episodes.send(heartbeat=common_pb2.Heartbeat(time_unix_s=time.time()))
            assert (await episodes.recv()).heartbeat.time_unix_s > 0
            assert episodes.seq == 5
            await episodes.call.done_writing()
            assert await episodes.call.read() is grpc.aio.EOF

    run(scenario())


@pytest.mark.integration
def test_calls_of_one_episode_keep_their_order_when_pipelined() -> None:
    async def scenario() -> None:
        async with envhub(builtin_envs=["letter"]) as hub:
            episodes = Episodes(hub)
            await episodes.open("letter")
            for n in range(5):  # reset, step and close sent without waiting for replies
                await episodes.reset(f"e{n}", seed=n, num_letters="1")
                await episodes.step(f"e{n}", "A")
                await episodes.send(close_episode=env_pb.CloseEpisodeRequest(episode_id=f"e{n}"))
            replies = [await episodes.recv() for _ in range(10)]
            kinds = {}
            for reply in replies:
                kind = reply.WhichOneof("payload")
                episode_id = getattr(reply, kind).episode_id
                kinds.setdefault(episode_id, []).append(kind)
            assert kinds == {f"e{n}": ["reset", "stepped"] for n in range(5)}
            assert all(r.stepped.result.reward == 1.0 for r in replies if r.HasField("stepped"))
            [builtin] = hub.deps.builtins
            for _ in range(40):
                if len(builtin.table) == 0:
                    break
                await asyncio.sleep(0.05)
            assert len(builtin.table) == 0  # every episode was closed after its step

    run(scenario())


@pytest.mark.integration
def test_unknown_env_is_not_found_naming_it() -> None:
    async def scenario() -> None:
        async with envhub(builtin_envs=["letter"]) as hub:
            episodes = Episodes(hub)
            await episodes.send(open=hub_pb.OpenEpisodes(job_id="j", env_name="chess"))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await episodes.recv()
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert "'chess'" in info.value.details() and "letter" in info.value.details()

    run(scenario())


@pytest.mark.integration
def test_register_renew_list_deregister_over_grpc() -> None:
    async def scenario() -> None:
        async with envhub(renew_interval_s=0.2, registration_ttl_s=1.0) as hub:
            handle = await hub.serve(LetterGame, name="letters", capacity=8)
            try:
                [instance] = await hub.instances("letters")
                assert (instance.address, instance.capacity) == (handle.address, 8)
                assert instance.instance_id == handle.instance_id
                await asyncio.sleep(1.5)  # > ttl: only renewals keep it
                assert [i.instance_id for i in await hub.instances("letters")] == [
                    handle.instance_id
                ]
                # Lose the registration as an EnvHub restart would: renewal gets NOT_FOUND and
                # the server registers again by itself.
                await hub.stub.DeregisterEnvironment(
                    hub_pb.DeregisterEnvironmentRequest(instance_id=instance.instance_id), timeout=5
                )
                for _ in range(40):
                    again = await hub.instances("letters")
                    if again:
                        break
                    await asyncio.sleep(0.05)
                assert len(again) == 1 and again[0].instance_id != instance.instance_id
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await hub.stub.RenewRegistration(
                        hub_pb.RenewRegistrationRequest(instance_id="nope"), timeout=5
                    )
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
            finally:
                await asyncio.to_thread(handle.stop, 0)
            assert await hub.instances("letters") == []  # deregistered on stop

    run(scenario())


@pytest.mark.integration
def test_two_instances_share_the_load() -> None:
    async def scenario() -> None:
        async with envhub() as hub:
            a = await hub.serve(LetterGame, name="letters", capacity=4)
            b = await hub.serve(LetterGame, name="letters", capacity=4)
            try:
                episodes = Episodes(hub)
                await episodes.open("letters")
                for n in range(6):
                    await episodes.reset(f"e{n}", seed=n)
                replies = [await episodes.recv() for _ in range(6)]
                assert all(r.WhichOneof("payload") == "reset" for r in replies)
                assert (len(a.table), len(b.table)) == (3, 3)
                assert sorted(i.active_episodes for i in await hub.instances()) == [3, 3]
                await episodes.call.done_writing()
                assert await episodes.call.read() is grpc.aio.EOF
                for _ in range(40):  # the stream closed: its episodes are closed on the servers
                    if len(a.table) + len(b.table) == 0:
                        break
                    await asyncio.sleep(0.05)
                assert (len(a.table), len(b.table)) == (0, 0)
                assert [i.active_episodes for i in await hub.instances()] == [0, 0]
            finally:
                await asyncio.gather(asyncio.to_thread(a.stop, 0), asyncio.to_thread(b.stop, 0))

    run(scenario())


def test_envhub_gives_up_on_a_slot_before_the_rollout_gives_up_on_envhub() -> None:
    from opentinker.services.rollout.settings import RolloutSettings

    rollout_deadline = RolloutSettings.model_fields["env_timeout_s"].default
    assert EnvHubSettings.model_fields["capacity_wait_s"].default < rollout_deadline


@pytest.mark.integration
def test_a_reset_at_capacity_waits_for_a_slot_then_fails_after_the_wait() -> None:
    """Jobs sharing an env queue for it: a Reset while every slot is held waits until another
    stream's episode closes; with nothing released it fails RESOURCE_EXHAUSTED after
    capacity_wait_s, naming the capacity."""

    async def scenario() -> None:
        async with envhub(capacity_wait_s=1.0) as hub:
            handle = await hub.serve(LetterGame, name="letters", capacity=2)
            try:
                first, second = Episodes(hub), Episodes(hub)
                await first.open("letters")
                await second.open("letters")
                for episode_id in ("a1", "a2"):
                    await first.reset(episode_id)
                    assert (await first.recv()).reset.episode_id == episode_id
                await second.reset("b1")  # both slots held: waits
                reply = asyncio.ensure_future(second.recv(timeout_s=5))
                await asyncio.sleep(0.3)
                assert not reply.done()  # (cancelling a read would end the whole call)
                await first.send(close_episode=env_pb.CloseEpisodeRequest(episode_id="a1"))
                assert (await reply).reset.episode_id == "b1"
                started = time.monotonic()
                await second.reset("b2")  # full again, and nothing closes now
                failed = (await second.recv(timeout_s=3)).failed
                assert (failed.episode_id, failed.code) == ("b2", "RESOURCE_EXHAUSTED")
                assert "at capacity" in failed.reason
                assert 0.9 <= time.monotonic() - started < 2.5
            finally:
                await asyncio.to_thread(handle.stop, 0)

    run(scenario())


@pytest.mark.integration
def test_a_slow_episode_does_not_block_others_and_game_errors_fail_one_episode() -> None:
    async def scenario() -> None:
        async with envhub() as hub:
            handle = await hub.serve(SlowGame)
            try:
                episodes = Episodes(hub)
                await episodes.open("slow")
                for episode_id in ("slow", "fast", "bad"):
                    await episodes.reset(episode_id)
                    assert (await episodes.recv()).reset.episode_id == episode_id
                started = time.monotonic()
                await episodes.step("slow", "1.0")
                await episodes.step("fast", "0.0")
                first = await episodes.recv()
                assert first.stepped.episode_id == "fast"
                assert time.monotonic() - started < 0.6
                await episodes.step("bad", "boom")
                failed = (await episodes.recv()).failed
                assert (failed.episode_id, failed.code) == ("bad", "INTERNAL")
                assert "'slow'" in failed.reason and handle.address in failed.reason
                assert "RuntimeError: out of cheese" in failed.reason
                assert (await episodes.recv(timeout_s=3)).stepped.episode_id == "slow"
            finally:
                await asyncio.to_thread(handle.stop, 0)

    run(scenario())


@pytest.mark.integration
def test_env_call_deadline_gives_episode_failed() -> None:
    async def scenario() -> None:
        async with envhub(env_call_timeout_s=0.5) as hub:
            handle = await hub.serve(SlowGame)
            try:
                episodes = Episodes(hub)
                await episodes.open("slow")
                await episodes.reset("e")
                await episodes.recv()
                await episodes.step("e", "3.0")
                failed = (await episodes.recv(timeout_s=2.5)).failed
                assert failed.code == "DEADLINE_EXCEEDED"
                assert "'slow'" in failed.reason and "within 0.5 s" in failed.reason
            finally:
                await asyncio.to_thread(handle.stop, 0)

    run(scenario())


@pytest.mark.integration
def test_a_stopped_env_server_fails_its_episodes_naming_it() -> None:
    async def scenario() -> None:
        async with envhub() as hub:
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
            await episodes.reset("e2")  # nothing left to route to
            assert (await episodes.recv()).failed.code == "NOT_FOUND"
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
                            env_name="slow", address=f"127.0.0.1:{port}", capacity=0
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


class Talker(AbstractGame):
    """Replies with an observation of as many characters as the action (or reset option) says."""

    name = "talker"

    def get_system_prompt(self) -> str:
        return ""

    def reset(self, *, seed: int = 0, length: str = "2") -> str:
        return "r" * int(length)

    def step(self, action: str) -> StepResult:
        return StepResult(observation="s" * int(action), reward=0.0, done=False)


@pytest.mark.integration
def test_an_observation_over_envhubs_limit_fails_the_episode_naming_env_and_size() -> None:
    async def scenario() -> None:
        async with envhub(max_observation_chars=50) as hub:
            # The SDK server's own limit is off, so only EnvHub's check stands in the way.
            handle = await hub.serve(Talker, max_observation_chars=0)
            try:
                episodes = Episodes(hub)
                await episodes.open("talker")
                await episodes.reset("e")
                await episodes.recv()
                await episodes.step("e", "50")
                assert len((await episodes.recv()).stepped.result.observation) == 50
                await episodes.step("e", "51")
                failed = (await episodes.recv()).failed
                assert (failed.episode_id, failed.code) == ("e", "INTERNAL")
                assert "'talker'" in failed.reason and handle.address in failed.reason
                assert "observation of 51 characters" in failed.reason
                assert "max_observation_chars (50)" in failed.reason
                await episodes.reset("big", length="60")
                failed = (await episodes.recv()).failed
                assert "Reset replied with an observation of 60 characters" in failed.reason
                for _ in range(40):  # both episodes were closed on the env server
                    if len(handle.table) == 0:
                        break
                    await asyncio.sleep(0.05)
                assert len(handle.table) == 0
                assert [i.active_episodes for i in await hub.instances("talker")] == [0]
            finally:
                await asyncio.to_thread(handle.stop, 0)

    run(scenario())


class NanEnvironment(environment_pb2_grpc.EnvironmentServiceServicer):
    """An env server written without the SDK (as another language would) that replies NaN."""

    async def GetEnvironmentSpec(self, request, context):  # noqa: N802
        return env_pb.GetEnvironmentSpecResponse(spec=env_pb.EnvironmentSpec(name="nan"))

    async def Reset(self, request, context):  # noqa: N802
        return env_pb.ResetResponse(observation="go")

    async def Step(self, request, context):  # noqa: N802
        return env_pb.StepResponse(reward=math.nan, done=True)

    async def CloseEpisode(self, request, context):  # noqa: N802
        return env_pb.CloseEpisodeResponse()


@pytest.mark.integration
def test_a_non_finite_reward_from_any_env_server_fails_the_episode() -> None:
    async def scenario() -> None:
        server = grpc.aio.server()
        environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(NanEnvironment(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with envhub() as hub:
                await hub.stub.RegisterEnvironment(
                    hub_pb.RegisterEnvironmentRequest(
                        env_name="nan", address=f"127.0.0.1:{port}", capacity=0
                    ),
                    timeout=5,
                )
                episodes = Episodes(hub)
                await episodes.open("nan")
                await episodes.reset("e")
                await episodes.recv()
                await episodes.step("e", "x")
                failed = (await episodes.recv()).failed
                assert failed.code == "INTERNAL" and "non-finite reward" in failed.reason
                assert "'nan'" in failed.reason
        finally:
            await server.stop(0)

    run(scenario())


def test_the_env_adapters_give_up_before_the_rollout_gives_up_on_envhub() -> None:
    from opentinker.services.envhub.adapters.serve_args import ADAPTER_TIMEOUT_S
    from opentinker.services.rollout.settings import RolloutSettings

    assert RolloutSettings.model_fields["env_timeout_s"].default > ADAPTER_TIMEOUT_S
