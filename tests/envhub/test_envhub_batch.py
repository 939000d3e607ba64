"""Batched RunEpisodes messages: EpisodeCalls in, EpisodeReplies out, through a real EnvHub.

EnvHub runs a batch's calls as if each came in its own message (episodes concurrently, one
episode's calls in order, a failure ends only its episode) and gathers the replies; the
rollout's client puts the calls of one event-loop tick into one message.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envhub_helpers import SlowGame  # the same slow/failing game as the single-call tests
from identity_helpers import user_channel, user_key

from opentinker.env_server import serve
from opentinker.envhub.v1 import envhub_pb2 as hub_pb
from opentinker.envhub.v1 import envhub_pb2_grpc
from opentinker.envhub.v1 import environment_pb2 as env_pb
from opentinker.game import AbstractGame, StepResult
from opentinker.grpc_options import MAX_MESSAGE_BYTES
from opentinker.services.envhub.server import EnvHubDeps, create_server
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.rollout.envs.envhub_client import EnvHubClient

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def envhub(*, with_nap: bool = False) -> AsyncIterator[tuple[str, EnvHubDeps]]:
    settings = EnvHubSettings(port=0, builtin_envs=["letter"], env_call_timeout_s=10.0)
    deps = EnvHubDeps.create(settings)
    server, port = await create_server(settings, deps)
    address = f"127.0.0.1:{port}"
    nap = None
    if with_nap:
        nap = await asyncio.to_thread(serve, SlowGame, envhub_address=address, block=False)
    try:
        yield address, deps
    finally:
        if nap is not None:
            await asyncio.to_thread(nap.stop, 0)
        await server.stop(0)
        await deps.close()


class Stream:
    """A raw RunEpisodes stream: messages written and read by hand."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = envhub_pb2_grpc.EnvHubServiceStub(channel).RunEpisodes(timeout=30)

    async def send(self, **payload: Any) -> None:
        await self.call.write(hub_pb.RunEpisodesRequest(**payload))

    async def open(self, env_name: str) -> None:
        await self.send(open=hub_pb.OpenEpisodes(job_id="j", env_name=env_name))
        assert (await self.recv()).HasField("opened")

    async def recv(self) -> hub_pb.RunEpisodesResponse:
        reply = await asyncio.wait_for(self.call.read(), 5)
        assert reply is not grpc.aio.EOF, "the stream ended"
        return reply

    async def replies(self, count: int) -> list[tuple[str, str, Any, float]]:
        """(kind, episode_id, reply, arrival time) of the next ``count`` episode replies."""
        got: list[tuple[str, str, Any, float]] = []
        while len(got) < count:
            reply = await self.recv()
            now = time.monotonic()
            kind = reply.WhichOneof("payload")
            if kind == "replies":
                for name in ("resets", "stepped", "failed"):
                    got += [(name, r.episode_id, r, now) for r in getattr(reply.replies, name)]
            else:
                body = getattr(reply, kind)
                got.append((kind, body.episode_id, body, now))
        return got


def resets(*episode_ids: str, **options: str) -> list[env_pb.ResetRequest]:
    return [env_pb.ResetRequest(episode_id=e, seed=0, options=options) for e in episode_ids]


def run(coro) -> None:  # noqa: ANN001 - a coroutine
    asyncio.run(asyncio.wait_for(coro, 30))


def test_a_batch_of_resets_of_many_episodes_answers_every_one_in_few_messages() -> None:
    async def scenario() -> None:
        async with envhub() as (address, _), user_channel(address) as channel:
            stream = Stream(channel)
            await stream.open("letter")
            ids = [f"e{n}" for n in range(100)]
            await stream.send(calls=hub_pb.EpisodeCalls(resets=resets(*ids, num_letters="8")))
            messages: list[hub_pb.RunEpisodesResponse] = []
            answered: list[hub_pb.EpisodeReset] = []
            while len(answered) < len(ids):
                messages.append(await stream.recv())
                assert messages[-1].WhichOneof("payload") == "replies"
                answered += messages[-1].replies.resets
            assert sorted(r.episode_id for r in answered) == sorted(ids)
            assert all("Answer with the letter" in r.result.observation for r in answered)
            assert len(messages) < len(ids) / 4  # gathered, not one message per reply
            assert [m.seq for m in messages] == list(range(2, 2 + len(messages)))

    run(scenario())


def test_one_episodes_calls_keep_their_order_within_and_across_messages() -> None:
    async def scenario() -> None:
        async with envhub() as (address, deps), user_channel(address) as channel:
            stream = Stream(channel)
            await stream.open("letter")
            ids = [f"e{n}" for n in range(20)]
            steps = [env_pb.StepRequest(episode_id=e, action="A") for e in ids]
            closes = [env_pb.CloseEpisodeRequest(episode_id=e) for e in ids[:10]]
            batch = hub_pb.EpisodeCalls(resets=resets(*ids, num_letters="1"), steps=steps)
            batch.closes.extend(closes)
            await stream.send(calls=batch)
            # A single-call message right behind the batch runs after the batch's calls: a
            # second step of a one-turn episode, refused as the episode is already done.
            await stream.send(step=env_pb.StepRequest(episode_id="e10", action="A"))
            got = await stream.replies(2 * len(ids) + 1)
            kinds: dict[str, list[str]] = {}
            for kind, episode_id, _, _ in got:
                kinds.setdefault(episode_id, []).append(kind)
            expected = {e: ["resets", "stepped"] for e in ids} | {
                "e10": ["resets", "stepped", "failed"]
            }
            assert kinds == expected
            assert all(r.result.reward == 1.0 for kind, _, r, _ in got if kind == "stepped")
            [refused] = [r for kind, _, r, _ in got if kind == "failed"]
            assert refused.code == "FAILED_PRECONDITION" and "already done" in refused.reason
            [builtin] = deps.builtins
            # The batch's closes ran after their episode's step (e0-e9 were answered); the
            # refused e10 is closed too; e11-e19 stay open.
            for _ in range(40):
                if len(builtin.table) == 9:
                    break
                await asyncio.sleep(0.05)
            assert len(builtin.table) == 9

    run(scenario())


def test_a_failing_or_slow_episode_in_a_batch_holds_back_no_other() -> None:
    async def scenario() -> None:
        async with (
            envhub(with_nap=True) as (address, _),
            user_channel(address) as channel,
        ):
            stream = Stream(channel)
            await stream.open(SlowGame.name)
            ids = ["slow", "boom", *(f"fast{n}" for n in range(8))]
            await stream.send(calls=hub_pb.EpisodeCalls(resets=resets(*ids)))
            assert {e for _, e, _, _ in await stream.replies(len(ids))} == set(ids)
            actions = {"slow": "1.5", "boom": "boom"}
            steps = [env_pb.StepRequest(episode_id=e, action=actions.get(e, "0")) for e in ids]
            sent = time.monotonic()
            await stream.send(calls=hub_pb.EpisodeCalls(steps=steps))
            got = {e: (kind, reply, at - sent) for kind, e, reply, at in await stream.replies(10)}
            assert got["boom"][0] == "failed" and "out of cheese" in got["boom"][1].reason
            assert got["slow"][0] == "stepped" and got["slow"][2] >= 1.4
            for n in range(8):
                kind, reply, after_s = got[f"fast{n}"]
                assert kind == "stepped" and reply.result.observation == "ok"
                assert after_s < 1.0  # sent long before the slow episode finished
            # The failed episode is gone; the others go on in the same stream.
            await stream.send(calls=hub_pb.EpisodeCalls(steps=steps[1:3]))
            after = {e: kind for kind, e, _, _ in await stream.replies(2)}
            assert after == {"boom": "failed", "fast0": "stepped"}

    run(scenario())


def test_single_call_messages_are_still_answered_one_by_one() -> None:
    async def scenario() -> None:
        async with envhub() as (address, _), user_channel(address) as channel:
            stream = Stream(channel)
            await stream.open("letter")
            await stream.send(reset=resets("solo", num_letters="1")[0])
            assert (await stream.recv()).reset.episode_id == "solo"
            await stream.send(calls=hub_pb.EpisodeCalls(resets=resets("batched")))
            assert [r.episode_id for r in (await stream.recv()).replies.resets] == ["batched"]
            await stream.send(step=env_pb.StepRequest(episode_id="solo", action="A"))
            stepped = (await stream.recv()).stepped
            assert (stepped.episode_id, stepped.result.reward) == ("solo", 1.0)
            await stream.call.done_writing()
            assert await stream.call.read() is grpc.aio.EOF

    run(scenario())


def test_the_client_sends_the_calls_of_one_tick_in_one_message_and_keeps_their_order() -> None:
    async def scenario() -> None:
        async with (
            envhub() as (address, deps),
            EnvHubClient(
                address, credential=user_key(), job_id="j", env_name="letter", timeout_s=10
            ) as client,
        ):
            sessions = [client.session(f"e{n}") for n in range(64)]
            first_seq = next(client._seq)
            await asyncio.gather(
                *(s.reset(n, {"num_letters": "1"}) for n, s in enumerate(sessions))
            )
            outcomes = await asyncio.gather(*(s.step("A") for s in sessions))
            assert [o.reward for o in outcomes] == [1.0] * 64
            await asyncio.gather(*(s.close() for s in sessions))
            # Three rounds of 64 calls took a handful of messages, not 192.
            assert next(client._seq) - first_seq <= 8
            # A close and a reset of one episode in the same tick: the reset goes after it.
            solo = client.session("solo")
            await solo.reset(0, {"num_letters": "1"})
            await asyncio.gather(solo.close(), solo.reset(1, {"num_letters": "1"}))
            assert (await solo.step("A")).reward == 1.0
            await solo.close()
            [builtin] = deps.builtins
            for _ in range(40):
                if len(builtin.table) == 0:
                    break
                await asyncio.sleep(0.05)
            assert len(builtin.table) == 0

    run(scenario())


class BigObservation(AbstractGame):
    """Resets to an observation of ``CHARS`` characters: within EnvHub's limit (raised in the
    test), but a few of them pass gRPC's message limit together."""

    name = "big-observation"
    CHARS = MAX_MESSAGE_BYTES // 3 + 1024

    def get_system_prompt(self) -> str:
        return ""

    def reset(self, *, seed: int = 0) -> str:
        return "x" * self.CHARS

    def step(self, action: str) -> StepResult:
        return StepResult(observation="ok", reward=0.0, done=True)


def test_replies_that_pass_the_message_limit_together_go_out_in_several_messages() -> None:
    """Each reply fits a gRPC message, three together do not (a vision env's batch gets there
    with default limits: 17 episodes of 4 images of 1 MiB). EnvHub once gathered them into one
    EpisodeReplies, which gRPC refused ('Sent message larger than max'), killing the stream
    and every episode of the rollout on it."""

    async def scenario() -> None:
        settings = EnvHubSettings(
            port=0, builtin_envs=[], max_observation_chars=2 * BigObservation.CHARS
        )
        deps = EnvHubDeps.create(settings)
        server, port = await create_server(settings, deps)
        address = f"127.0.0.1:{port}"
        env = await asyncio.to_thread(
            serve, BigObservation, envhub_address=address, block=False, max_observation_chars=0
        )
        try:
            async with EnvHubClient(
                address, credential=user_key(), job_id="j", env_name=BigObservation.name,
                timeout_s=20,
            ) as client:  # fmt: skip
                sessions = [client.session(f"e{n}") for n in range(3)]
                resets = await asyncio.gather(*(s.reset(n, {}) for n, s in enumerate(sessions)))
                assert [len(r.observation) for r in resets] == [BigObservation.CHARS] * 3
                assert client.broken is None
                assert (await sessions[0].step("A")).done
        finally:
            await asyncio.to_thread(env.stop, 0)
            await server.stop(0)
            await deps.close()

    run(scenario())
