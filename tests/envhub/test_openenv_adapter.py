"""The OpenEnv adapter against real OpenEnv servers (openenv's ``create_app`` under uvicorn,
started here; see openenv_servers.py): the echo env's text action, a JSON action, MCP tool
calls, registration with a real EnvHub and an episode through it, the CLI, and the errors an
unreachable, failing or malformed server turns into."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import grpc
import pytest
from identity_helpers import user_channel
from openenv_servers import openenv_server
from websockets.sync.server import serve as ws_serve

from opentinker.env_server import EnvServerHandle, serve
from opentinker.envhub.v1 import envhub_pb2 as hub_pb
from opentinker.envhub.v1 import envhub_pb2_grpc, environment_pb2_grpc
from opentinker.envhub.v1 import environment_pb2 as pb
from opentinker.services.envhub.adapters import openenv_session
from opentinker.services.envhub.adapters.openenv_actions import ActionFormat, observation_text
from opentinker.services.envhub.adapters.openenv_game import (
    OpenEnvGame,
    OpenEnvTarget,
    discover,
)
from opentinker.services.envhub.server import EnvHubDeps
from opentinker.services.envhub.server import create_server as create_envhub
from opentinker.services.envhub.settings import EnvHubSettings

pytestmark = pytest.mark.integration


class Adapted:
    """An OpenEnv server behind the adapter's env server; ``stub`` talks to it over gRPC."""

    def __init__(self, target: OpenEnvTarget, envhub_address: str | None = None) -> None:
        self.handle: EnvServerHandle = serve(
            lambda: OpenEnvGame(target), envhub_address=envhub_address, block=False
        )
        self.channel = self.handle.channel()
        self.stub = environment_pb2_grpc.EnvironmentServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.handle.stop(grace_s=0)

    def spec(self) -> pb.EnvironmentSpec:
        return self.stub.GetEnvironmentSpec(pb.GetEnvironmentSpecRequest(), timeout=10).spec

    def reset(self, episode_id: str, seed: int = 0, **options: str) -> pb.ResetResponse:
        request = pb.ResetRequest(episode_id=episode_id, seed=seed, options=options)
        return self.stub.Reset(request, timeout=20)

    def step(self, episode_id: str, action: str) -> pb.StepResponse:
        return self.stub.Step(pb.StepRequest(episode_id=episode_id, action=action), timeout=20)


@contextlib.contextmanager
def adapted(kind: str) -> Iterator[Adapted]:
    with openenv_server(kind) as url:
        env = Adapted(discover(url, name=kind, timeout_s=20))
        try:
            yield env
        finally:
            env.close()


def rpc_error(call, *args: object) -> grpc.RpcError:  # noqa: ANN001 - a bound stub helper
    with pytest.raises(grpc.RpcError) as info:
        call(*args)
    return info.value


def test_echo_text_is_the_message_and_reward_and_done_map() -> None:
    with adapted("echo") as env:
        spec = env.spec()
        assert (spec.name, list(spec.tools)) == ("echo", [])
        first = env.reset("e", seed=7)
        assert first.observation == "Echo environment ready!\nmessage_length: 0"
        assert "plain text" in first.system_prompt
        hello = env.step("e", "hello")
        # the echo env's reward: 0.1 per character, 5 characters
        assert (hello.observation, hello.done) == ("hello\nmessage_length: 5", False)
        assert hello.reward == pytest.approx(0.5)
        bye = env.step("e", "bye")
        assert (bye.done, bye.reward) == (True, pytest.approx(0.3))
        err = rpc_error(env.step, "e", "again")  # done: the episode takes no more steps
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_json_action_follows_the_schema_and_bad_ones_are_told_to_the_model() -> None:
    with adapted("counter") as env:
        reset = env.reset("c", target="3")  # "3" reaches the env's reset as the number 3
        assert json.loads(reset.observation) == {"target": 3, "total": 0}
        assert '"delta"' in reset.system_prompt  # the action schema is shown to the model
        told = env.step("c", "add two please")
        assert told.observation.startswith("Invalid action: your reply is not one JSON object")
        assert (told.reward, told.done, "action_error" in told.info) == (0.0, False, True)
        lacking = env.step("c", '{"note": "hi"}')
        assert "lacks the required field(s) ['delta']" in lacking.observation
        refused = env.step("c", '{"delta": "two"}')  # the server's own validation refuses it
        assert "VALIDATION_ERROR" in refused.observation and not refused.done
        partial = env.step("c", 'Sure.\n```json\n{"delta": 2}\n```')
        assert (json.loads(partial.observation)["total"], partial.reward) == (2, 0.0)  # null -> 0
        final = env.step("c", '{"delta": 1, "note": "done"}')
        assert (final.reward, final.done) == (1.0, True)


def test_mcp_tools_reach_the_spec_and_tool_calls_run_on_the_server() -> None:
    with adapted("calc") as env:
        tools = {tool.name: tool for tool in env.spec().tools}
        assert set(tools) == {"add", "shout"}
        assert "Add two integers" in tools["add"].description
        assert set(json.loads(tools["add"].parameters_json_schema)["properties"]) == {"a", "b"}
        assert env.reset("m").observation == "Use the tools to compute 2 + 3."
        add = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        shout = '<tool_call>{"name": "shout", "arguments": {"text": "hi"}}</tool_call>'
        both = env.step("m", f"{add}\n{shout}")
        assert both.observation == (
            "<tool_response>\n5\n</tool_response>\n<tool_response>\nHI\n</tool_response>"
        )
        crash = '<tool_call>{"name": "shout", "arguments": {"text": "crash"}}</tool_call>'
        broke = env.step("m", crash)
        assert "error:" in broke.observation and "the shouting tool broke" in broke.observation
        unknown = env.step("m", '<tool_call>{"name": "mul", "arguments": {}}</tool_call>')
        assert "unknown tool 'mul'" in unknown.observation and not unknown.done
        answer = env.step("m", "The answer is 5.")  # no tool call: the episode ends
        assert (answer.done, answer.info["stop"]) == (True, "no_tool_call")


def test_server_errors_become_status_codes() -> None:
    with openenv_server("counter") as url:
        target = discover(url, name="counter", timeout_s=20)
        env = Adapted(target)
        env.reset("neg")
        failed = rpc_error(env.step, "neg", '{"delta": -1}')  # the env raises in step
        assert failed.code() == grpc.StatusCode.INTERNAL
        assert "EXECUTION_ERROR" in failed.details() and "no going back" in failed.details()
        assert rpc_error(env.step, "neg", '{"delta": 1}').code() == grpc.StatusCode.NOT_FOUND
        env.reset("live")
    try:  # the OpenEnv server is gone now
        err = rpc_error(env.step, "live", '{"delta": 1}')
        assert err.code() == grpc.StatusCode.UNAVAILABLE and url in err.details()
        err = rpc_error(env.reset, "new")
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "unreachable" in err.details() and url in err.details()
    finally:
        env.close()


@contextlib.contextmanager
def malformed_server(reply: str) -> Iterator[str]:
    """A WebSocket server that answers every message with ``reply``; yields its URL."""

    def handler(connection) -> None:  # noqa: ANN001 - the websockets connection
        for _ in connection:
            connection.send(reply)

    with ws_serve(handler, "127.0.0.1", 0) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.socket.getsockname()[1]}"
        finally:
            server.shutdown()


def reset_error(url: str) -> grpc.RpcError:
    """The error of resetting one episode of the OpenEnv server at ``url``, adapted."""
    target = OpenEnvTarget(
        url=url,
        name="odd",
        action_format=ActionFormat.of({}),
        system_prompt="",
        max_turns=0,
        timeout_s=5,
    )
    env = Adapted(target)
    try:
        return rpc_error(env.reset, "e")
    finally:
        env.close()


@pytest.mark.parametrize(
    ("reply", "problem"),
    [
        ("not json", "reset reply is not JSON"),
        ('{"type": "observation"}', "reset reply has no 'data' object"),
        ('{"type": "state", "data": {}}', "has type 'state', not observation"),
        ('{"type": "observation", "data": {"observation": [], "done": false}}', "not an object"),
        (
            '{"type": "observation", "data": {"observation": {}, "reward": "high", "done": false}}',
            "reward is 'high', not a finite number",
        ),
        (
            '{"type": "observation", "data": {"observation": {}, "done": "no"}}',
            "'done' is 'no', not true/false",
        ),
    ],
)
def test_malformed_replies_are_internal_errors_naming_the_problem(reply: str, problem: str) -> None:
    with malformed_server(reply) as url:
        err = reset_error(url)
    assert err.code() == grpc.StatusCode.INTERNAL
    assert f"OpenEnv server {url} replied badly" in err.details() and problem in err.details()


def test_observation_text_of_plain_fields() -> None:
    assert observation_text({"board": "x.o", "turn": 2, "legal": None}) == "x.o\nturn: 2"
    assert observation_text({"a": 1, "b": [2]}) == '{"a":1,"b":[2]}'
    assert observation_text({"tool_name": "t", "result": {"content": [{"text": "ok"}]}}) == (
        "<tool_response>\nok\n</tool_response>"
    )


async def _episode_through_envhub(url: str) -> tuple[list[hub_pb.EnvironmentInstance], object]:
    settings = EnvHubSettings(port=0, builtin_envs=[], env_call_timeout_s=10.0)
    deps = EnvHubDeps.create(settings)
    hub, port = await create_envhub(settings, deps)
    address = f"127.0.0.1:{port}"
    target = await asyncio.to_thread(discover, url, name="echo-hub", timeout_s=20)
    env = await asyncio.to_thread(Adapted, target, address)
    try:
        async with user_channel(address) as channel:
            stub = envhub_pb2_grpc.EnvHubServiceStub(channel)
            listed = await stub.ListEnvironments(hub_pb.ListEnvironmentsRequest(), timeout=5)
            call = stub.RunEpisodes(timeout=30)
            open_ = hub_pb.OpenEpisodes(job_id="job-1", env_name="echo-hub")
            await call.write(hub_pb.RunEpisodesRequest(seq=1, open=open_))
            await call.read()
            reset = pb.ResetRequest(episode_id="e1", seed=1)
            await call.write(hub_pb.RunEpisodesRequest(seq=2, reset=reset))
            await call.read()
            step = pb.StepRequest(episode_id="e1", action="bye")
            await call.write(hub_pb.RunEpisodesRequest(seq=3, step=step))
            stepped = (await call.read()).stepped
            await call.done_writing()
        return list(listed.instances), stepped
    finally:
        await asyncio.to_thread(env.close)
        await hub.stop(0)
        await deps.close()


def test_the_adapter_registers_with_envhub_and_plays_through_it() -> None:
    with openenv_server("echo") as url:
        instances, stepped = asyncio.run(_episode_through_envhub(url))
    assert [i.env_name for i in instances] == ["echo-hub"]
    assert (stepped.episode_id, stepped.result.done) == ("e1", True)
    assert stepped.result.reward == pytest.approx(0.3)  # 3 characters of "bye"


def unauthenticated_reset(address: str) -> grpc.StatusCode:
    """The status of a Reset sent straight to an env server, with no env token."""
    with grpc.insecure_channel(address) as channel:
        stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
        try:
            stub.Reset(pb.ResetRequest(episode_id="direct"), timeout=10)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_the_cli_serves_and_registers(tmp_path: Path) -> None:
    """... and its server answers EnvHub alone: a direct Reset is UNAUTHENTICATED."""

    async def scenario(url: str, log: IO[str]) -> tuple[list[str], grpc.StatusCode | None]:
        settings = EnvHubSettings(port=0, builtin_envs=[])
        deps = EnvHubDeps.create(settings)
        hub, port = await create_envhub(settings, deps)
        command = [
            sys.executable,
            "-m",
            "opentinker",
            "serve",
            "openenv-adapter",
            "--url",
            url,
            "--envhub",
            f"127.0.0.1:{port}",
            "--name",
            "echo-cli",
        ]
        process = subprocess.Popen(
            command,
            env=dict(os.environ),
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            async with user_channel(f"127.0.0.1:{port}") as channel:
                stub = envhub_pb2_grpc.EnvHubServiceStub(channel)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and process.poll() is None:
                    reply = await stub.ListEnvironments(hub_pb.ListEnvironmentsRequest())
                    if reply.instances:
                        [record] = deps.registry.instances()
                        code = await asyncio.to_thread(unauthenticated_reset, record.address)
                        return [i.env_name for i in reply.instances], code
                    await asyncio.sleep(0.2)
                return [], None
        finally:
            process.terminate()
            process.wait(10)
            await hub.stop(0)
            await deps.close()

    with (tmp_path / "adapter.log").open("w") as log, openenv_server("echo") as url:
        names, direct = asyncio.run(scenario(url, log))
    assert names == ["echo-cli"], (tmp_path / "adapter.log").read_text()[-2000:]
    assert direct == grpc.StatusCode.UNAUTHENTICATED


def test_an_oversized_reply_is_refused_without_reading_it_whole(monkeypatch) -> None:
    monkeypatch.setattr(openenv_session, "MAX_REPLY_BYTES", 64 * 1024)
    huge = json.dumps({"type": "observation", "data": {"observation": {"x": "y" * 100_000}}})
    with malformed_server(huge) as url:
        err = reset_error(url)
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "reset reply is larger than 65536 bytes" in err.details()
