"""EnvHub, the real service routing episodes to real env servers: the built-in env, ordering,
unknown envs, registration over gRPC, load sharing. Faults: test_envhub_faults.py and
test_envhub_lost_servers.py."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from envhub_helpers import Episodes, envhub, run

from opentinker.common.v1 import common_pb2
from opentinker.envhub.v1 import envhub_pb2 as hub_pb
from opentinker.envhub.v1 import environment_pb2 as env_pb
from opentinker.services.envhub.games.letter_env import LetterGame


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
                assert instance.capacity == 8  # its address is for admins only (test_env_auth)
                assert hub.instance(instance.instance_id).address == handle.address
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
                # ... with the env token it had: nothing rotates under episodes in flight.
                assert hub.instance(again[0].instance_id).env_token == handle.env_token
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
