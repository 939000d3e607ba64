"""Env servers take calls only from their EnvHub (issue 37): a direct GetEnvironmentSpec, Reset,
Step or CloseEpisode without the env token the server registered with, or with a wrong one, is
UNAUTHENTICATED (the SDK's ``serve``, EnvHub's built-in env servers on their ports); through
EnvHub episodes still run; ListEnvironments shows addresses to admins only; no token reaches a
log. Real gRPC servers on 127.0.0.1, a real EnvHub, real credentials."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
from envhub_helpers import Episodes, envhub
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from opentinker.env_auth import ENV_TOKEN_METADATA_KEY, new_env_token
from opentinker.env_server import EnvServerHandle, serve
from opentinker.envhub.v1 import envhub_pb2 as hub_pb
from opentinker.envhub.v1 import envhub_pb2_grpc, environment_pb2_grpc
from opentinker.envhub.v1 import environment_pb2 as pb
from opentinker.errors import InvalidArgumentError
from opentinker.game import AbstractGame, StepResult
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.envhub.server import EnvHubDeps
from opentinker.services.envhub.settings import EnvHubSettings

pytestmark = pytest.mark.integration


class Counting(AbstractGame):
    """Counts the resets and steps that reached the game."""

    name = "counting"
    calls: list[str] = []

    def get_system_prompt(self) -> str:
        return ""

    def reset(self, *, seed: int = 0) -> str:
        Counting.calls.append("reset")
        return "go"

    def step(self, action: str) -> StepResult:
        Counting.calls.append("step")
        return StepResult(observation="ok", reward=1.0, done=True)


def _calls(stub: environment_pb2_grpc.EnvironmentServiceStub, metadata=()):  # noqa: ANN001, ANN202
    return {
        "GetEnvironmentSpec": lambda: stub.GetEnvironmentSpec(
            pb.GetEnvironmentSpecRequest(), timeout=5, metadata=metadata
        ),
        "Reset": lambda: stub.Reset(
            pb.ResetRequest(episode_id="e", seed=1), timeout=5, metadata=metadata
        ),
        "Step": lambda: stub.Step(
            pb.StepRequest(episode_id="e", action="x"), timeout=5, metadata=metadata
        ),
        "CloseEpisode": lambda: stub.CloseEpisode(
            pb.CloseEpisodeRequest(episode_id="e"), timeout=5, metadata=metadata
        ),
    }


def assert_refused(address: str, env_token: str) -> None:
    """Every EnvironmentService method at ``address``, called with no token, a wrong one, one
    differing only in its last character, and the right one twice: UNAUTHENTICATED, with a
    message naming the metadata key and never the token."""
    wrong = new_env_token()
    near = env_token[:-1] + ("A" if env_token[-1] != "A" else "B")
    attempts = {
        "none": (),
        "wrong": ((ENV_TOKEN_METADATA_KEY, wrong),),
        "near": ((ENV_TOKEN_METADATA_KEY, near),),
        "twice": ((ENV_TOKEN_METADATA_KEY, env_token), (ENV_TOKEN_METADATA_KEY, env_token)),
        "as bearer": (("authorization", f"Bearer {env_token}"),),
    }
    with grpc.insecure_channel(address) as channel:
        stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
        for what, metadata in attempts.items():
            for method, call in _calls(stub, metadata).items():
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (what, method)
                details = info.value.details()
                assert ENV_TOKEN_METADATA_KEY in details and "EnvHub" in details, details
                assert env_token not in details and wrong not in details
        # Health checks stay open.
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def counting() -> Iterator[EnvServerHandle]:
    Counting.calls.clear()
    handle = serve(Counting, block=False)
    yield handle
    handle.stop(grace_s=0)


def test_a_direct_call_without_the_env_token_is_unauthenticated(
    counting: EnvServerHandle,
) -> None:
    with capture_logs() as logs:
        assert_refused(counting.address, counting.env_token)
    assert Counting.calls == []  # nothing reached the game
    refused = [e for e in logs if e["event"] == "env_call_refused"]
    assert len(refused) == 20 and counting.env_token not in str(logs)
    # With the token (what EnvHub presents), the same calls are served.
    with counting.channel() as channel:
        stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
        assert stub.Reset(pb.ResetRequest(episode_id="e"), timeout=5).observation == "go"
        assert stub.Step(pb.StepRequest(episode_id="e", action="x"), timeout=5).done
    assert Counting.calls == ["reset", "step"]


def test_each_server_has_its_own_token_and_a_bad_one_is_refused_at_start() -> None:
    first, second = serve(Counting, block=False), serve(Counting, block=False)
    try:
        assert first.env_token != second.env_token and len(first.env_token) >= 32
        assert first.env_token not in repr(first)
        with grpc.insecure_channel(first.address) as channel:
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.GetEnvironmentSpec(
                    pb.GetEnvironmentSpecRequest(),
                    timeout=5,
                    metadata=((ENV_TOKEN_METADATA_KEY, second.env_token),),
                )
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        first.stop(grace_s=0)
        second.stop(grace_s=0)
    chosen = "c" * 40
    with_chosen = serve(Counting, env_token=chosen, block=False)
    try:
        assert with_chosen.env_token == chosen
        assert_refused(with_chosen.address, chosen)
    finally:
        with_chosen.stop(grace_s=0)
    with pytest.raises(InvalidArgumentError, match="env_token must be 32 to 256"):
        serve(Counting, env_token="short", block=False)


def test_envhubs_built_in_env_servers_refuse_direct_calls() -> None:
    """The issue's case: with no credential, code_math's port ran code in its sandbox."""

    async def scenario() -> None:
        settings = EnvHubSettings(port=0, builtin_envs=["code_math", "letter"])
        deps = await asyncio.to_thread(EnvHubDeps.create, settings)
        try:
            for handle in deps.builtins:
                [instance] = deps.registry.instances(handle.table.env_name)
                assert instance.address == handle.address
                await asyncio.to_thread(assert_refused, handle.address, handle.env_token)
                assert len(handle.table) == 0  # no episode was opened
        finally:
            await deps.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_episodes_run_through_envhub_and_registration_needs_a_token() -> None:
    async def scenario() -> None:
        Counting.calls.clear()
        async with envhub() as hub:
            with capture_logs() as logs:
                handle = await hub.serve(Counting, name="counting")
            try:
                # EnvHub presents the token over the network: the episode runs.
                episodes = Episodes(hub)
                assert (await episodes.open("counting")).name == "counting"
                await episodes.reset("a", seed=1)
                assert (await episodes.recv()).reset.result.observation == "go"
                await episodes.step("a", "x")
                stepped = (await episodes.recv()).stepped
                assert (stepped.result.reward, stepped.result.done) == (1.0, True)
                assert Counting.calls == ["reset", "step"]
                episodes.call.cancel()
                # Direct calls to the registered server are refused all the same.
                await asyncio.to_thread(assert_refused, handle.address, handle.env_token)
                assert Counting.calls == ["reset", "step"]
                assert handle.env_token not in str(logs)
                # A registration without a token is refused, naming the field.
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await hub.stub.RegisterEnvironment(
                        hub_pb.RegisterEnvironmentRequest(
                            env_name="open", address="127.0.0.1:1", capacity=1
                        ),
                        timeout=5,
                    )
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "env_token" in info.value.details()
            finally:
                await asyncio.to_thread(handle.stop, 0)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_list_environments_shows_addresses_to_admins_only(identities) -> None:  # noqa: ANN001
    async def scenario() -> None:
        async with envhub(builtin_envs=["letter"]) as hub:
            private = await hub.serve(Counting, name="counting")
            try:

                async def listed(key: str) -> dict[str, hub_pb.EnvironmentInstance]:
                    async with aio_channel(hub.address, credential=key) as channel:
                        stub = envhub_pb2_grpc.EnvHubServiceStub(channel)
                        reply = await stub.ListEnvironments(
                            hub_pb.ListEnvironmentsRequest(), timeout=5
                        )
                    return {i.env_name: i for i in reply.instances}

                user, other, admin = (
                    await listed(identities.user_key),
                    await listed(identities.other_tenant_key),
                    await listed(identities.admin_key),
                )
                assert set(user) == set(admin) == {"counting", "letter"}
                assert set(other) == {"letter"}
                for entries in (user, other):  # listed, but with no address to knock on
                    assert all(i.address == "" and i.instance_id for i in entries.values())
                assert admin["counting"].address == private.address
                assert admin["letter"].address.startswith("127.0.0.1:")
            finally:
                await asyncio.to_thread(private.stop, 0)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_server_that_refuses_its_registered_token_is_dropped_and_its_episode_restarts() -> None:
    """A server restarted at a registered address has a new token: EnvHub's calls with the old
    one are refused. That registration is of no use any more: EnvHub drops it and fails the
    episode UNAVAILABLE, which the rollout restarts on a live instance (test_rollout_failover
    runs that restart)."""

    async def scenario() -> None:
        Counting.calls.clear()
        async with envhub() as hub:
            first = await asyncio.to_thread(serve, Counting, name="counting", block=False)
            await hub.register("counting", first.address, env_token=first.env_token)
            restarted: EnvServerHandle | None = None
            try:
                episodes = Episodes(hub)
                await episodes.open("counting")
                await episodes.reset("a", seed=1)
                assert (await episodes.recv()).reset.result.observation == "go"
                await asyncio.to_thread(first.stop, 0)  # as if killed: still registered
                restarted = await asyncio.to_thread(
                    serve, Counting, name="counting", port=first.port, block=False
                )
                await episodes.step("a", "x")
                failed = (await episodes.recv()).failed
                assert failed.code == "UNAVAILABLE", failed
                assert "refused the env token" in failed.reason
                assert restarted.env_token not in failed.reason
                assert first.env_token not in failed.reason
                assert [i.instance_id for i in hub.deps.registry.instances()] == []
                assert Counting.calls == ["reset"]  # the step never reached a game
            finally:
                await asyncio.to_thread(first.stop, 0)
                if restarted is not None:
                    await asyncio.to_thread(restarted.stop, 0)

    asyncio.run(asyncio.wait_for(scenario(), 60))
