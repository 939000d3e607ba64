"""The verifiers adapter: small verifiers envs (datasets built in memory, nothing downloaded)
served as OpenTinker environments over real gRPC: a SingleTurnEnv scored by its rubric, a
MultiTurnEnv whose env_response and stop condition drive the turns, a ToolEnv whose tool calls
come from the model's text, and the errors a broken env turns into."""

from __future__ import annotations

import json

import grpc
import pytest
import verifiers as vf
from datasets import Dataset

from opentinker.env_server import serve
from opentinker.envhub.v1 import environment_pb2 as pb
from opentinker.envhub.v1 import environment_pb2_grpc
from opentinker.services.envhub.adapters.verifiers_adapter import parse_args
from opentinker.services.envhub.adapters.verifiers_game import (
    VerifiersGame,
    VerifiersSource,
    load_environment,
)

pytestmark = pytest.mark.integration

QUESTIONS = [
    {"question": "What is 2 + 3?", "answer": "5"},
    {"question": "What is 4 * 4?", "answer": "16"},
]


def exact_answer(completion, answer, **kwargs) -> float:
    """1.0 when the model's last message is the answer."""
    return 1.0 if completion[-1]["content"].strip() == answer else 0.0


def load_single_turn() -> vf.Environment:
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(QUESTIONS),
        system_prompt="Answer with the number only.",
        rubric=vf.Rubric(funcs=[exact_answer]),
    )


class GuessEnv(vf.MultiTurnEnv):
    """Guess the answer; 'higher'/'lower' hints until right or out of turns."""

    async def env_response(self, messages, state, **kwargs):
        guess = messages[-1]["content"].strip()
        target = int(state["answer"])
        if guess == str(target):
            state["final_env_response"] = [{"role": "user", "content": "Right!"}]
            return state["final_env_response"]
        hint = "higher" if not guess.isdigit() or int(guess) < target else "lower"
        return [{"role": "user", "content": hint}]


def solved(completion, answer, **kwargs) -> float:
    """1.0 when some guess was right, fewer points the more turns it took (1 / guesses)."""
    guesses = [m["content"].strip() for m in completion if m["role"] == "assistant"]
    return 1.0 / len(guesses) if answer in guesses else 0.0


def load_guess() -> vf.Environment:
    return GuessEnv(
        dataset=Dataset.from_list(QUESTIONS), max_turns=4, rubric=vf.Rubric(funcs=[solved])
    )


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def used_tool_and_right(completion, answer, **kwargs) -> float:
    tool_results = [m["content"] for m in completion if m["role"] == "tool"]
    return 1.0 if answer in tool_results and completion[-1]["content"].strip() == answer else 0.0


def load_tools() -> vf.Environment:
    return vf.ToolEnv(
        dataset=Dataset.from_list(QUESTIONS[:1]),
        tools=[add],
        max_turns=3,
        rubric=vf.Rubric(funcs=[used_tool_and_right]),
    )


class BrokenEnv(vf.MultiTurnEnv):
    """Its env_response raises, as a buggy env does."""

    async def env_response(self, messages, state, **kwargs):
        raise RuntimeError("the oracle is out to lunch")


def load_broken() -> vf.Environment:
    return BrokenEnv(
        dataset=Dataset.from_list(QUESTIONS), max_turns=3, rubric=vf.Rubric(funcs=[solved])
    )


class Served:
    """A verifiers env behind a real env server; ``stub`` talks to it over gRPC."""

    def __init__(self, env: vf.Environment, name: str) -> None:
        source = VerifiersSource(env=env, name=name, timeout_s=20.0)
        self.handle = serve(lambda: VerifiersGame(source), block=False)
        self.channel = self.handle.channel()
        self.stub = environment_pb2_grpc.EnvironmentServiceStub(self.channel)

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.channel.close()
        self.handle.stop(grace_s=0)

    def reset(self, episode_id: str, seed: int = 0, **options: str) -> pb.ResetResponse:
        request = pb.ResetRequest(episode_id=episode_id, seed=seed, options=options)
        return self.stub.Reset(request, timeout=20)

    def step(self, episode_id: str, action: str) -> pb.StepResponse:
        return self.stub.Step(pb.StepRequest(episode_id=episode_id, action=action), timeout=20)


def test_single_turn_reset_formats_the_row_and_the_rubric_scores_it() -> None:
    with Served(load_single_turn(), "arith") as env:
        spec = env.stub.GetEnvironmentSpec(pb.GetEnvironmentSpecRequest(), timeout=5).spec
        assert (spec.name, spec.max_turns) == ("arith", 1)
        first = env.reset("right", seed=0)
        assert first.system_prompt == "Answer with the number only."
        assert first.observation == "What is 2 + 3?"
        right = env.step("right", " 5 ")
        assert (right.reward, right.done) == (1.0, True)
        assert right.info["metric_exact_answer"] == "1.0"
        assert right.info["stop_condition"] == "max_turns_reached"
        assert env.reset("wrong", seed=3).observation == "What is 4 * 4?"  # row 3 % 2 = 1
        wrong = env.step("wrong", "15")
        assert (wrong.reward, wrong.done) == (0.0, True)


def test_multi_turn_env_response_and_stop_conditions_drive_the_turns() -> None:
    with Served(load_guess(), "guess") as env:
        assert env.reset("e", seed=1).observation == "What is 4 * 4?"
        first = env.step("e", "9")
        assert (first.observation, first.reward, first.done) == ("higher", 0.0, False)
        second = env.step("e", "20")
        assert (second.observation, second.done) == ("lower", False)
        third = env.step("e", "16")
        # final_env_response ends it; the rubric scores 1 / 3 guesses
        assert (third.observation, third.done) == ("Right!", True)
        assert third.reward == pytest.approx(1 / 3)
        assert third.info["stop_condition"] == "has_final_env_response"
        env.reset("cap", seed=1)
        for guess in ("1", "2", "3"):
            assert not env.step("cap", guess).done
        capped = env.step("cap", "4")  # the env's max_turns (4) stops it, unsolved
        assert (capped.done, capped.reward, capped.info["stop_condition"]) == (
            True,
            0.0,
            "max_turns_reached",
        )


def test_tool_env_runs_the_models_tool_calls() -> None:
    with Served(load_tools(), "adder") as env:
        spec = env.stub.GetEnvironmentSpec(pb.GetEnvironmentSpecRequest(), timeout=5).spec
        [tool] = spec.tools
        assert tool.name == "add" and "Add two integers" in tool.description
        assert set(json.loads(tool.parameters_json_schema)["properties"]) == {"a", "b"}
        env.reset("e")
        call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        called = env.step("e", call)
        assert called.observation == "<tool_response>\n5\n</tool_response>"
        assert not called.done
        answered = env.step("e", "5")  # no tool call: ToolEnv's no_tools_called stops it
        assert (answered.reward, answered.done) == (1.0, True)
        assert answered.info["stop_condition"] == "no_tools_called"


def test_a_failing_env_and_bad_options_are_clear_errors() -> None:
    with Served(load_broken(), "broken") as env:
        env.reset("e")
        with pytest.raises(grpc.RpcError) as info:
            env.step("e", "5")
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "verifiers env 'broken' failed" in info.value.details()
        assert "RuntimeError: the oracle is out to lunch" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:  # a failed episode is gone
            env.step("e", "5")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as info:
            env.reset("bad", split="test")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "split" in info.value.details() and "'test'" in info.value.details()
        # verifiers' own rule: without an eval dataset, eval episodes use the train rows
        assert env.reset("eval", split="eval", seed=1).observation == "What is 4 * 4?"


def test_the_adapted_server_refuses_calls_without_its_env_token() -> None:
    with Served(load_single_turn(), "arith") as env:
        with grpc.insecure_channel(env.handle.address) as channel:  # no env token
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.Reset(pb.ResetRequest(episode_id="direct"), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert env.reset("e").observation  # EnvHub's way (the token) is served


def test_the_cli_loads_module_colon_function() -> None:
    args = parse_args(["--env", "test_verifiers_adapter:load_guess", "--env-args", "{}"])
    env = load_environment(args.env, args.env_args)
    assert isinstance(env, GuessEnv) and env.max_turns == 4
    with pytest.raises(ValueError, match="has no function 'nope'"):
        load_environment("test_verifiers_adapter:nope")
    with pytest.raises(ValueError, match="not a verifiers Environment"):
        load_environment(
            "test_verifiers_adapter:exact_answer", {"completion": [{"content": ""}], "answer": ""}
        )
