"""An env's tools reach the model through its chat template, and its calls reach the env.

The tiny model's tokenizer is given a Qwen2.5-style template (its tools section and
``<tool_call>`` format, as Qwen2.5-Instruct ships it, abridged to the parts tools touch).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Mapping, Sequence
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from opentinker.auth import api_key_from_env
from opentinker.env_auth import new_env_token
from opentinker.envhub.v1 import environment_pb2, environment_pb2_grpc
from opentinker.envhub_registration import EnvHubRegistration
from opentinker.services.common.tool_calls import (
    HERMES,
    ToolCall,
    ToolCalls,
    parse_tool_calls,
    style_of,
)
from opentinker.services.envhub.server import EnvHubDeps
from opentinker.services.envhub.server import create_server as create_envhub
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.rollout.agent.agent_loop import AgentLoop
from opentinker.services.rollout.agent.chat_format import ChatFormat
from opentinker.services.rollout.agent.loop_config import EpisodeRequest, LoopConfig
from opentinker.services.rollout.config import RolloutConfig
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.session import RolloutSession
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.rollout.types import (
    Completion,
    EnvSpec,
    ResetResult,
    RoleSpec,
    StepOutcome,
    ToolSpec,
    Trajectory,
)
from opentinker.spec import ModelSpec, SamplingParams

pytestmark = pytest.mark.integration

QWEN25_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n"
    "<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CALC = ToolSpec(
    "calc",
    "Evaluate an arithmetic expression.",
    {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
)


def test_hermes_calls_are_parsed_and_bad_ones_are_named() -> None:
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2+2"}}\n'
        '</tool_call>\n<tool_call>{"name": "calc", "arguments": "{\\"expr\\": \\"3\\"}"}'
        '</tool_call><tool_call>{"name": "calc", oops}</tool_call>'
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call><tool_call>{"name": "calc"'
    )
    parsed = parse_tool_calls(text, {"calc"}, HERMES)
    assert parsed.calls == (ToolCall("calc", {"expr": "2+2"}), ToolCall("calc", {"expr": "3"}))
    assert [e.split(":")[0] for e in parsed.errors] == ["call 3", "call 4", "call 5"]
    assert "not JSON" in parsed.errors[0]
    assert "unknown tool 'rm'" in parsed.errors[1]
    assert "no closing </tool_call>" in parsed.errors[2]
    assert parse_tool_calls(text, {"calc"}, None) == ToolCalls()  # no known format: raw only
    assert style_of(QWEN25_TOOLS_TEMPLATE) == HERMES and style_of("{{ messages }}") is None


DEEP = "[" * 5000  # a model stuck on one token: nested past the JSON parser's recursion limit


def test_calls_a_json_parser_cannot_take_or_other_envs_cannot_read_are_errors() -> None:
    """Python's json reads NaN and Infinity (not JSON: an env in another language fails on
    the arguments_json they travel as) and raises RecursionError, not JSONDecodeError, on
    deep nesting, which escaped the agent loop and failed the whole batch and job."""
    text = (
        f'<tool_call>{{"name": "calc", "arguments": {{"expr": {DEEP}}}}}</tool_call>'
        '<tool_call>{"name": "calc", "arguments": {"expr": NaN}}</tool_call>'
        '<tool_call>{"name": "calc", "arguments": "{\\"expr\\": -Infinity}"}</tool_call>'
        '<tool_call>{"name": "calc", "arguments": {"expr": "1"}}</tool_call>'
    )
    parsed = parse_tool_calls(text, {"calc"}, HERMES)
    assert parsed.calls == (ToolCall("calc", {"expr": "1"}),)
    assert [e.split(":")[0] for e in parsed.errors] == ["call 1", "call 2", "call 3"]
    assert "nested too deeply" in parsed.errors[0]
    assert "NaN" in parsed.errors[1] and "-Infinity" in parsed.errors[2]


def test_a_number_too_large_for_a_float_is_an_error_not_infinity() -> None:
    """1e400 is JSON, but Python reads it as inf, which the call's arguments_json would carry
    as Infinity (not JSON): the call is an error naming the number, not a call with inf."""
    text = (
        '<tool_call>{"name": "calc", "arguments": {"x": 1e400}}</tool_call>'
        '<tool_call>{"name": "calc", "arguments": "{\\"x\\": [-2E+999]}"}</tool_call>'
        '<tool_call>{"name": "calc", "arguments": {"x": 1.5e300}}</tool_call>'
    )
    parsed = parse_tool_calls(text, {"calc"}, HERMES)
    assert parsed.calls == (ToolCall("calc", {"x": 1.5e300}),)
    assert len(parsed.errors) == 2, parsed.errors
    assert "(1e400 is beyond a float's range)" in parsed.errors[0]
    assert "(-2E+999 is beyond a float's range)" in parsed.errors[1]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TransformersEngine:
    model_dir: Path = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))
    base = TransformersEngine.load(ModelSpec(base_model=str(model_dir), finetune="full"))
    tokenizer = copy.deepcopy(base.tokenizer)
    tokenizer.chat_template = QWEN25_TOOLS_TEMPLATE
    return TransformersEngine(base.model, tokenizer)


def test_the_template_renders_the_envs_tools_into_the_prompt(engine: TransformersEngine) -> None:
    chat = ChatFormat(engine.tokenizer, (CALC,))
    prompt = engine.tokenizer.decode(chat.prompt_ids("Be exact.", "What is 2+2?"))
    assert prompt.startswith("<|im_start|>system\nBe exact.\n\n# Tools")
    assert '"name": "calc"' in prompt and '"required": ["expr"]' in prompt
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert chat.renders_tools() and chat.tool_call_style == HERMES
    plain = ChatFormat(engine.tokenizer)  # no tools: the prompt has no tools section
    assert "# Tools" not in engine.tokenizer.decode(plain.prompt_ids("Be exact.", "Hi"))


class ScriptedEngine:
    """The real engine, its completions replaced by scripted replies (one per turn): the tiny
    model's random text never holds a tool call."""

    def __init__(self, engine: TransformersEngine, replies: list[str]) -> None:
        self.inner, self.replies = engine, replies
        self.name, self.tokenizer = engine.name, engine.tokenizer

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        self.inner.generate(prompts, sampling, seed)
        ids = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False)
        ids.append(self.tokenizer.eos_token_id)
        return [Completion(token_ids=ids, logprobs=[0.0] * len(ids)) for _ in prompts]


class CalcSession:
    """A calculator env played in-process: records what each step was given."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, ToolCalls | None]] = []

    async def reset(self, seed: int, options: Mapping[str, str]) -> ResetResult:
        return ResetResult("Be exact.", "What is 2+2?")

    async def step(self, action: str, tool_calls: ToolCalls | None = None) -> StepOutcome:
        self.steps.append((action, tool_calls))
        return StepOutcome("4", 0.0, done=len(self.steps) == 2)

    async def close(self) -> None:
        pass


def play_calc(
    engine: TransformersEngine, replies: list[str], *, max_new_tokens: int = 64
) -> tuple[Trajectory, CalcSession]:
    """One two-turn episode of the calculator env, the model's turns scripted."""
    config = LoopConfig(
        sampling=SamplingParams(max_new_tokens=max_new_tokens),
        max_turns=None,
        max_episode_tokens=max_new_tokens + 2048,
    )
    scripted = ScriptedEngine(engine, list(replies))
    loop = AgentLoop(scripted, config, EnvSpec(name="calc", tools=(CALC,), max_turns=2))  # type: ignore[arg-type]
    session = CalcSession()
    trajectories, _ = asyncio.run(loop.run([EpisodeRequest("e0", 0, 1, session)], seed=0))
    return trajectories[0], session


def test_an_env_with_tools_gets_the_raw_text_and_the_parsed_calls(
    engine: TransformersEngine,
) -> None:
    replies = [
        '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+2"}}\n</tool_call>',
        '<tool_call>{"name": "calc", oops}</tool_call>',
    ]
    trajectory, session = play_calc(engine, replies)
    assert trajectory.num_turns == 2
    (first, first_calls), (second, second_calls) = session.steps
    assert (first, second) == (replies[0], replies[1])  # the raw text, always
    assert first_calls == ToolCalls(calls=(ToolCall("calc", {"expr": "2+2"}),))
    assert second_calls is not None and second_calls.calls == ()
    assert len(second_calls.errors) == 1 and second_calls.errors[0].startswith("call 1: not JSON")


class TwoRoleCalcSession(CalcSession):
    """The calculator played by two roles in turn (left, then right), two steps in all."""

    async def reset(self, seed: int, options: Mapping[str, str]) -> ResetResult:
        return ResetResult("Be exact.", "What is 2+2?", next_role="left")

    async def step(self, action: str, tool_calls: ToolCalls | None = None) -> StepOutcome:
        self.steps.append((action, tool_calls))
        done = len(self.steps) == 2
        rewards = {"left": 1.0, "right": 0.0} if done else {}
        return StepOutcome("4", 0.0, done=done, next_role="right", role_rewards=rewards)


def test_self_play_roles_with_tools_give_the_env_the_parsed_calls(
    engine: TransformersEngine,
) -> None:
    """The self-play loop stepped with the raw text alone, while every role's prompt showed
    the env's tools: an env with tools never got a call from a multi-agent game."""
    reply = '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+2"}}\n</tool_call>'
    config = LoopConfig(
        sampling=SamplingParams(max_new_tokens=64), max_turns=None, max_episode_tokens=4096
    )
    roles = (RoleSpec("left", "You are LEFT."), RoleSpec("right", "You are RIGHT."))
    spec = EnvSpec(name="calc2", tools=(CALC,), max_turns=2, roles=roles)
    loop = AgentLoop(ScriptedEngine(engine, [reply, reply]), config, spec)  # type: ignore[arg-type]
    session = TwoRoleCalcSession()
    asyncio.run(loop.run([EpisodeRequest("g0", 0, 1, session)], seed=0))  # type: ignore[arg-type]
    assert [calls for _, calls in session.steps] == [
        ToolCalls(calls=(ToolCall("calc", {"expr": "2+2"}),))
    ] * 2


def test_a_turn_nested_past_the_parsers_limit_is_a_call_error_not_a_failed_batch(
    engine: TransformersEngine,
) -> None:
    replies = [f"<tool_call>{DEEP}</tool_call>", '<tool_call>{"name": "calc"}</tool_call>']
    trajectory, session = play_calc(engine, replies, max_new_tokens=6000)
    assert trajectory.num_turns == 2, trajectory.finish_detail
    (_, first_calls), (_, second_calls) = session.steps
    assert first_calls is not None and first_calls.calls == ()
    assert first_calls.errors[0].startswith("call 1: not JSON (nested too deeply")
    assert second_calls == ToolCalls(calls=(ToolCall("calc", {}),))


class RecordingCalcEnv(environment_pb2_grpc.EnvironmentServiceServicer):
    """An env written against the protos alone (no SDK game): declares the calc tool and
    records every StepRequest it receives."""

    def __init__(self) -> None:
        self.steps: list[environment_pb2.StepRequest] = []

    def GetEnvironmentSpec(self, request, context):  # noqa: N802 - gRPC method name
        tool = environment_pb2.ToolSpec(
            name=CALC.name,
            description=CALC.description,
            parameters_json_schema=json.dumps(CALC.parameters),
        )
        spec = environment_pb2.EnvironmentSpec(name="calc", tools=[tool], max_turns=1)
        return environment_pb2.GetEnvironmentSpecResponse(spec=spec)

    def Reset(self, request, context):  # noqa: N802
        return environment_pb2.ResetResponse(observation="What is 2+2?")

    def Step(self, request, context):  # noqa: N802
        self.steps.append(request)
        return environment_pb2.StepResponse(observation="", reward=1.0, done=True)

    def CloseEpisode(self, request, context):  # noqa: N802
        return environment_pb2.CloseEpisodeResponse()


def test_parsed_calls_reach_an_env_server_through_envhub(engine: TransformersEngine) -> None:
    env = RecordingCalcEnv()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(env, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    reply = '<tool_call>{"name": "calc", "arguments": {"expr": "2+2"}}</tool_call>'
    scripted = ScriptedEngine(engine, [reply])

    async def scenario() -> None:
        settings = EnvHubSettings(port=0, builtin_envs=[], env_call_timeout_s=5.0)
        deps = EnvHubDeps.create(settings)
        hub, hub_port = await create_envhub(settings, deps)
        registration = EnvHubRegistration(
            f"127.0.0.1:{hub_port}",
            env_name="calc",
            address=f"127.0.0.1:{port}",
            capacity=0,
            api_key=api_key_from_env(None),
            env_token=new_env_token(),  # this hand-made server checks none
        )
        try:
            await asyncio.to_thread(registration.start)
            session = RolloutSession(
                RolloutSettings(envhub_address=f"127.0.0.1:{hub_port}", device="cpu"),
                lambda spec: scripted,  # type: ignore[arg-type, return-value]
            )
            await session.open(
                RolloutConfig(
                    job_id="job-tools",
                    model=ModelSpec(base_model="preloaded", finetune="full"),
                    env_name="calc",
                    sampling=SamplingParams(max_new_tokens=64),
                )
            )
            batch = await session.collect(0, num_groups=1, group_size=1)
            assert batch.trajectories[0].reward == 1.0
        finally:
            await asyncio.to_thread(registration.stop)
            await hub.stop(0)
            await deps.close()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        server.stop(0)
    (step,) = env.steps
    assert step.action == reply
    assert [(c.name, json.loads(c.arguments_json)) for c in step.tool_calls] == [
        ("calc", {"expr": "2+2"})
    ]
    assert list(step.tool_call_errors) == []


class NoPromptSession(CalcSession):
    async def reset(self, seed: int, options: Mapping[str, str]) -> ResetResult:
        return ResetResult("", "What is 2+2?")


def test_the_specs_system_prompt_stands_in_when_reset_sends_none(
    engine: TransformersEngine,
) -> None:
    config = LoopConfig(
        sampling=SamplingParams(max_new_tokens=4), max_turns=1, max_episode_tokens=512
    )
    env = EnvSpec(name="calc", system_prompt="From the spec.")
    loop = AgentLoop(engine, config, env)
    own, none = CalcSession(), NoPromptSession()  # Reset sends "Be exact." / nothing
    requests = [EpisodeRequest("own", 0, 1, own), EpisodeRequest("none", 1, 1, none)]
    trajectories, _ = asyncio.run(loop.run(requests, seed=0))
    assert [t.messages[0].content for t in trajectories] == ["Be exact.", "From the spec."]
