"""The SDK's env server: a real gRPC EnvironmentService on 127.0.0.1, called with real stubs."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from opentinker.env_server import EnvServerHandle, serve
from opentinker.envhub.v1 import environment_pb2 as pb
from opentinker.envhub.v1 import environment_pb2_grpc
from opentinker.game import AbstractGame, StepResult, Tool
from opentinker.services.envhub.games.letter_env import LetterGame

pytestmark = pytest.mark.integration


class TestGame(AbstractGame):
    """Multi-turn; the action chooses what step does (to exercise every server path)."""

    __test__ = False  # not a pytest test class
    name = "testgame"
    description = "for tests"
    max_turns = 5
    closed: list[str] = []

    def __init__(self) -> None:
        self.seed = -1

    def get_system_prompt(self) -> str:
        return "system"

    def get_initial_user_message(self) -> str:
        return "Intro."

    def reset(self, *, seed: int = 0, greeting: str = "hello") -> str:
        self.seed = seed
        return f"{greeting} {seed}"

    def step(self, action: str) -> StepResult:
        if action == "boom":
            raise RuntimeError("the board caught fire")
        if action == "nan":
            return StepResult(observation="", reward=math.nan, done=False)
        if action == "not-str":
            return StepResult(observation=42, reward=0.0, done=False)  # type: ignore[arg-type]
        if action == "slow":
            time.sleep(1.0)
        if action.startswith("big:"):  # an observation of that many characters
            return StepResult(observation="x" * int(action[4:]), reward=0.0, done=False)
        return StepResult(observation=f"got {action}", reward=0.5, done=action == "end")

    def close(self) -> None:
        TestGame.closed.append(str(self.seed))


def start(game: type[AbstractGame] = TestGame, **options: object) -> EnvServerHandle:
    return serve(game, block=False, **options)  # type: ignore[arg-type]


@pytest.fixture
def server() -> Iterator[EnvServerHandle]:
    handle = start()
    yield handle
    handle.stop(grace_s=0)


@pytest.fixture
def stub(server: EnvServerHandle) -> Iterator[environment_pb2_grpc.EnvironmentServiceStub]:
    with server.channel() as channel:
        yield environment_pb2_grpc.EnvironmentServiceStub(channel)


def reset(stub, episode_id: str, seed: int = 0, **options: str) -> pb.ResetResponse:
    return stub.Reset(pb.ResetRequest(episode_id=episode_id, seed=seed, options=options), timeout=5)


def step(stub, episode_id: str, action: str) -> pb.StepResponse:
    return stub.Step(pb.StepRequest(episode_id=episode_id, action=action), timeout=5)


def test_reset_step_close(stub, server: EnvServerHandle) -> None:
    reply = reset(stub, "e1", seed=7, greeting="hi")
    assert reply.system_prompt == "system"
    assert reply.observation == "Intro.\n\nhi 7"  # intro and reset observation, blank line
    stepped = step(stub, "e1", "move")
    assert (stepped.observation, stepped.reward, stepped.done) == ("got move", 0.5, False)
    assert step(stub, "e1", "end").done is True
    with pytest.raises(grpc.RpcError) as info:
        step(stub, "e1", "again")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    stub.CloseEpisode(pb.CloseEpisodeRequest(episode_id="e1"), timeout=5)
    assert len(server.table) == 0
    assert "7" in TestGame.closed  # the game's close hook ran
    stub.CloseEpisode(pb.CloseEpisodeRequest(episode_id="e1"), timeout=5)  # harmless again


def test_spec_and_health(stub, server: EnvServerHandle) -> None:
    spec = stub.GetEnvironmentSpec(pb.GetEnvironmentSpecRequest(), timeout=5).spec
    assert (spec.name, spec.description, spec.system_prompt, spec.max_turns) == (
        "testgame",
        "for tests",
        "system",
        5,
    )
    with server.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_letter_game_served(tmp_path) -> None:
    handle = start(LetterGame)
    try:
        with handle.channel() as channel:
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
            first = reset(stub, "a", seed=5, num_letters="3")
            target = first.observation.removeprefix("Answer with the letter ").rstrip(".")
            assert target in "ABC"
            result = step(stub, "a", f" {target} ")
            assert (result.reward, result.done, dict(result.info)) == (
                1.0,
                True,
                {"target": target, "outcome": "win"},
            )
            with pytest.raises(grpc.RpcError) as info:
                reset(stub, "b", seed=5, num_letters="40")
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "letter" in info.value.details() and "num_letters" in info.value.details()
    finally:
        handle.stop(grace_s=0)


def test_unknown_episode_is_not_found(stub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        step(stub, "never-reset", "x")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "never-reset" in info.value.details()


def test_unknown_reset_option_is_invalid_argument(stub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        reset(stub, "e", colour="blue")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "testgame" in info.value.details() and "colour" in info.value.details()


def test_reset_of_a_live_episode_replaces_it(stub, server: EnvServerHandle) -> None:
    reset(stub, "e", seed=1)
    assert reset(stub, "e", seed=2).observation.endswith("hello 2")
    assert len(server.table) == 1


def test_exception_in_step_fails_that_episode_only(stub, server: EnvServerHandle) -> None:
    reset(stub, "bad")
    reset(stub, "good")
    with pytest.raises(grpc.RpcError) as info:
        step(stub, "bad", "boom")
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "testgame" in info.value.details()
    assert "RuntimeError: the board caught fire" in info.value.details()
    with pytest.raises(grpc.RpcError) as again:
        step(stub, "bad", "move")
    assert again.value.code() == grpc.StatusCode.NOT_FOUND  # the failed episode was dropped
    assert step(stub, "good", "move").observation == "got move"


@pytest.mark.parametrize(("action", "words"), [("nan", "non-finite"), ("not-str", "not str")])
def test_malformed_step_result_is_refused(stub, action: str, words: str) -> None:
    reset(stub, "e")
    with pytest.raises(grpc.RpcError) as info:
        step(stub, "e", action)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "testgame" in info.value.details() and words in info.value.details()


def test_idle_episodes_are_reaped() -> None:
    handle = start(idle_timeout_s=0.3)
    try:
        with handle.channel() as channel:
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
            reset(stub, "idle")
            reset(stub, "busy")
            deadline = time.monotonic() + 1.2
            while time.monotonic() < deadline:  # keep one episode in use
                step(stub, "busy", "move")
                time.sleep(0.05)
            assert len(handle.table) == 1
            with pytest.raises(grpc.RpcError) as info:
                step(stub, "idle", "move")
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        handle.stop(grace_s=0)


def test_capacity_is_enforced() -> None:
    handle = start(capacity=1)
    try:
        with handle.channel() as channel:
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
            reset(stub, "one")
            with pytest.raises(grpc.RpcError) as info:
                reset(stub, "two")
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "capacity" in info.value.details()
    finally:
        handle.stop(grace_s=0)


def test_a_slow_step_does_not_delay_other_episodes(stub) -> None:
    reset(stub, "slow")
    reset(stub, "fast")
    slow_done: list[float] = []
    started = time.monotonic()

    def slow_step() -> None:
        step(stub, "slow", "slow")
        slow_done.append(time.monotonic())

    worker = threading.Thread(target=slow_step)
    worker.start()
    time.sleep(0.1)  # the slow step is now sleeping inside the game
    step(stub, "fast", "move")
    fast_took = time.monotonic() - started
    worker.join(timeout=5)
    assert fast_took < 0.6, f"the fast step waited {fast_took:.2f} s behind the slow one"
    assert slow_done and slow_done[0] - started >= 1.0


def test_an_observation_over_the_limit_is_never_sent() -> None:
    handle = start(max_observation_chars=100)
    try:
        with handle.channel() as channel:
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
            reset(stub, "e")
            assert len(step(stub, "e", "big:100").observation) == 100  # at the limit: fine
            with pytest.raises(grpc.RpcError) as info:
                step(stub, "e", "big:101")
            assert info.value.code() == grpc.StatusCode.INTERNAL
            details = info.value.details()
            assert "'testgame'" in details and "step observation is 101 characters" in details
            assert "max_observation_chars (100)" in details
            assert len(handle.table) == 0  # the episode was dropped
            with pytest.raises(grpc.RpcError) as too_long:
                reset(stub, "r", greeting="y" * 200)  # "Intro.\n\n" + 200 + " 0"
            assert "reset observation is 210 characters" in too_long.value.details()
    finally:
        handle.stop(grace_s=0)
    unlimited = start(max_observation_chars=0)
    try:
        with unlimited.channel() as channel:
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
            reset(stub, "e")
            assert len(step(stub, "e", "big:100000").observation) == 100_000
    finally:
        unlimited.stop(grace_s=0)


class ToolGame(TestGame):
    __test__ = False
    name = "toolgame"
    tools = (
        Tool(
            "search", "Look a word up.", {"type": "object", "properties": {"q": {"type": "string"}}}
        ),
        Tool("noop", "Does nothing."),
    )


def test_the_spec_lists_a_games_tools_and_none_by_default(stub) -> None:
    assert list(stub.GetEnvironmentSpec(pb.GetEnvironmentSpecRequest(), timeout=5).spec.tools) == []
    handle = start(ToolGame)
    try:
        with handle.channel() as channel:
            tool_stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
            spec = tool_stub.GetEnvironmentSpec(pb.GetEnvironmentSpecRequest(), timeout=5).spec
    finally:
        handle.stop(grace_s=0)
    assert [(t.name, t.description) for t in spec.tools] == [
        ("search", "Look a word up."),
        ("noop", "Does nothing."),
    ]
    assert spec.tools[0].parameters_json_schema == (
        '{"properties": {"q": {"type": "string"}}, "type": "object"}'
    )
    assert spec.tools[1].parameters_json_schema == '{"type": "object"}'


def test_invalid_name_is_refused_and_the_game_built_to_describe_it_closed() -> None:
    """The server builds one game to read its spec; refused for its name or limits, it left
    that game open (a sandbox or a container the game holds, never freed)."""
    closed, built = len(TestGame.closed), []

    def factory() -> TestGame:
        built.append(TestGame())
        return built[-1]

    with pytest.raises(ValueError, match="name"):
        serve(factory, name="bad name!", block=False)
    with pytest.raises(ValueError, match="capacity"):
        serve(factory, capacity=-1, block=False)
    assert built and len(TestGame.closed) - closed == len(built)


def test_importing_the_env_authoring_api_never_imports_torch() -> None:
    code = (
        "import sys, opentinker.env_server, opentinker.game; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


class SlowResetGame(TestGame):
    __test__ = False

    def reset(self, *, seed: int = 0, greeting: str = "hello") -> str:
        time.sleep(0.5)
        return super().reset(seed=seed, greeting=greeting)


def test_capacity_holds_for_resets_that_arrive_together() -> None:
    """The capacity was checked before the game was built and reset, and the episode added
    after: resets arriving together all passed the check, and a server of capacity 1 ran
    several games at once (the very games its capacity is there to bound)."""
    handle = start(SlowResetGame, capacity=1)
    codes: list[grpc.StatusCode] = []
    try:
        with handle.channel() as channel:
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)

            def try_reset(episode_id: str) -> None:
                try:
                    reset(stub, episode_id)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as err:
                    codes.append(err.code())

            threads = [threading.Thread(target=try_reset, args=(f"e{i}",)) for i in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=10)
        assert sorted(c.name for c in codes) == ["OK", "RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED"]
        assert len(handle.table) == 1
    finally:
        handle.stop(grace_s=0)
