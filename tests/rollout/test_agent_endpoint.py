"""The per-episode OpenAI-compatible endpoint on the tiny model, in-process: an agent program
written against the ``openai`` client plays through it; its recorded tokens are exactly the
engine's, its masks cover only the model's turns; a wrong key is refused; streaming works; a
rewritten message starts a new segment and is counted."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from agent_loop_helpers import Countdown, GameSession, RecordingEngine, model_turns

from opentinker.services.rollout.agent.agent_loop import AgentLoop
from opentinker.services.rollout.agent.loop_config import EpisodeRequest, LoopConfig
from opentinker.services.rollout.agent_endpoint.openai_wire import reply_message
from opentinker.services.rollout.agent_endpoint.segments import EpisodeRecord
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.types import FinishReason, Trajectory
from opentinker.spec import SamplingParams
from opentinker.spec_agent import AgentProgram

pytestmark = pytest.mark.integration


@pytest.fixture
def engine(base_engine: TransformersEngine) -> RecordingEngine:
    return RecordingEngine(base_engine)


def play_with(
    engine: RecordingEngine, program: AgentProgram, sessions: list[GameSession]
) -> list[Trajectory]:
    config = LoopConfig(
        sampling=SamplingParams(temperature=1.0, max_new_tokens=8),
        max_turns=4,
        max_episode_tokens=512,
        agent=program,
    )
    requests = [EpisodeRequest(f"ep-{n}", n, n, s) for n, s in enumerate(sessions)]

    async def run() -> list[Trajectory]:
        loop = AgentLoop(engine, config)  # type: ignore[arg-type]
        assert loop.agent_programs is not None
        try:
            trajectories, stats = await loop.run(requests, seed=5)
        finally:
            await loop.agent_programs.close()
        assert stats.generated_tokens == sum(sum(t.loss_mask) for t in trajectories)
        return trajectories

    return asyncio.run(run())


def test_a_tool_calling_agent_records_exactly_the_engines_tokens(engine: RecordingEngine) -> None:
    sessions = [GameSession(Countdown(turns=1)) for _ in range(3)]
    program = AgentProgram(callable="agent_programs:calculator_agent")
    trajectories = play_with(engine, program, sessions)
    produced = [c.token_ids for c in engine.completions]
    assert len(produced) == 6  # 3 episodes x (ask, answer after the calculator's result)
    # The first turn of every program went in one engine call: the first call waits (up to
    # calls.FIRST_WAIT_S) for every program to start and call.
    assert engine.calls[0] == 3, engine.calls
    for t, session in zip(trajectories, sessions, strict=True):
        assert (t.finish_reason, t.reward) == (FinishReason.ENV_DONE, 0.25), t.finish_detail
        assert t.info["agent_calls"] == "2" and t.info["agent_rewrites"] == "0"
        turns = model_turns(t)
        assert len(turns) == 2 and all(turn in produced for turn in turns)
        completion = t.token_ids[t.prompt_length :]
        tokenizer = engine.tokenizer
        # Masked tokens are exactly the model's turns; logprobs only there.
        model_tokens = [tok for tok, m in zip(completion, t.loss_mask, strict=True) if m]
        assert model_tokens == turns[0] + turns[1]
        assert all((lp < 0) == bool(m) for lp, m in zip(t.logprobs, t.loss_mask, strict=True))
        # Between the turns: the eos closing turn 1 (unless the model's own) and the user
        # message the agent added, as the chat template renders it.
        between = [tok for tok, m in zip(completion, t.loss_mask, strict=True) if not m]
        assert "calculator(2+3) = 5" in tokenizer.decode(between)
        # The env graded the text of the last reply, decoded from the engine's own tokens.
        assert session.actions == [tokenizer.decode(turns[1], skip_special_tokens=True)]
        assert t.turn_ends == [len(completion)] or t.turn_ends[-1] == len(completion)
        assert session.closed


def test_streaming_and_a_returned_reward(engine: RecordingEngine) -> None:
    program = AgentProgram(callable="agent_programs:streaming_agent")
    [t] = play_with(engine, program, [GameSession(Countdown(turns=1))])
    text = engine.tokenizer.decode(engine.completions[0].token_ids, skip_special_tokens=True)
    assert t.reward == pytest.approx(min(1.0, len(text) / 10))
    assert t.finish_reason is FinishReason.ENV_DONE
    assert model_turns(t) == [engine.completions[0].token_ids]


async def _probe_keys(base_url: str, api_key: str) -> dict:
    async with httpx.AsyncClient() as http:
        wrong = await http.get(f"{base_url}/models", headers={"Authorization": "Bearer nope"})
        models = await http.get(
            f"{base_url}/models", headers={"Authorization": f"Bearer {api_key}"}
        )
        other = await http.get(
            base_url.replace("/episodes/", "/episodes/x") + "/models",
            headers={"Authorization": f"Bearer {api_key}"},
        )
    return {"wrong": wrong, "models": models, "other": other}


PROBES: list[dict] = []


async def key_probe_agent(*, base_url: str, api_key: str, task: str, seed: int) -> float:
    """Calls with a wrong key and another episode's path, then one real call (async callable)."""
    PROBES.append(await _probe_keys(base_url, api_key))
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task}]
    )
    with pytest.raises(openai.BadRequestError, match="n: Input should be less than or equal"):
        await client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "x"}], n=2
        )
    with pytest.raises(openai.BadRequestError, match="messages: List should have at least 1"):
        await client.chat.completions.create(model="p", messages=[])
    bad = openai.AsyncOpenAI(base_url=base_url, api_key="stolen", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="wrong or missing API key"):
        await bad.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
    return 1.0


def test_only_the_episodes_key_is_served(engine: RecordingEngine) -> None:
    program = AgentProgram(callable="test_agent_endpoint:key_probe_agent")
    [t] = play_with(engine, program, [GameSession(Countdown(turns=1))])
    assert t.finish_reason is FinishReason.ENV_DONE and t.reward == 1.0, t.finish_detail
    [probe] = PROBES
    assert probe["wrong"].status_code == 401
    assert "wrong or missing API key" in probe["wrong"].json()["error"]["message"]
    assert probe["models"].status_code == 200 and probe["models"].json()["data"]
    assert probe["other"].status_code == 404


def test_a_failing_program_ends_its_episode_with_the_reason(engine: RecordingEngine) -> None:
    program = AgentProgram(command=("python", "-c", "import sys; sys.exit('no luck')"))
    [t] = play_with(engine, program, [GameSession(Countdown(turns=1))])
    assert t.finish_reason is FinishReason.ENV_ERROR
    assert "exited with 1" in t.finish_detail and "no luck" in t.finish_detail


# Prefix matching, unit level: the record of one episode's calls.


def _reply(record: EpisodeRecord, ids: list[int], text: str, tools: list[str] = ()) -> dict:
    message = reply_message(text, list(tools))
    record.add_reply(ids, [-0.5] * len(ids), message)
    return message


def test_a_continued_conversation_keeps_one_segment(base_engine: TransformersEngine) -> None:
    tokenizer = base_engine.tokenizer
    record = EpisodeRecord(tokenizer)
    first = [{"role": "user", "content": "hi"}]
    prompt = record.prompt(first, None)
    sampled = tokenizer.encode("hello", add_special_tokens=False) + [tokenizer.eos_token_id]
    reply = _reply(record, sampled, "hello")
    second = record.prompt(
        [*first, dict(reply, refusal=None), {"role": "user", "content": "more"}], None
    )
    assert second[: len(prompt) + len(sampled)] == prompt + sampled  # the engine's ids, kept
    [segment] = record.segments
    added = second[len(prompt) + len(sampled) :]
    assert "more" in tokenizer.decode(added) and record.rewrites == 0
    assert segment.loss_mask == [1] * len(sampled) + [0] * len(added)


def test_a_rewritten_message_starts_a_new_segment(base_engine: TransformersEngine) -> None:
    record = EpisodeRecord(base_engine.tokenizer)
    first = [{"role": "user", "content": "hi"}]
    record.prompt(first, None)
    _reply(record, [5, 6, 7], "abc")
    rewritten = [*first, {"role": "assistant", "content": "abd"}, {"role": "user", "content": "?"}]
    ids = record.prompt(rewritten, None)
    assert (record.rewrites, len(record.segments)) == (1, 2)
    assert record.segments[1].prompt_length == len(ids) and record.segments[1].loss_mask == []
    # Changing the tools also starts over; so does an assistant message the agent wrote itself.
    record.prompt(
        [*rewritten, {"role": "user", "content": "!"}],
        [{"type": "function", "function": {"name": "f"}}],
    )
    assert record.rewrites == 2


def test_tool_calls_round_trip_the_record(base_engine: TransformersEngine) -> None:
    record = EpisodeRecord(base_engine.tokenizer)
    first = [{"role": "user", "content": "2+3?"}]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    record.prompt(first, tools)
    call_text = '{"name": "calculator", "arguments": {"expression": "2+3"}}'
    text = f"Let me see.<tool_call>{call_text}</tool_call>"
    reply = _reply(record, [9, 10], text, ["calculator"])
    assert reply["content"] == "Let me see."
    [call] = reply["tool_calls"]
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "2+3"}'}
    # The client sends the call back with its arguments re-serialized: still the same turn.
    echoed = {
        "role": "assistant",
        "content": "Let me see.",
        "tool_calls": [
            {
                "id": "other",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression":"2+3"}'},
            }
        ],
    }
    record.prompt(
        [*first, echoed, {"role": "tool", "tool_call_id": "other", "content": "5"}], tools
    )
    assert record.rewrites == 0 and len(record.segments) == 1
