"""The agent loop on the tiny model against in-process games: masks, ids, budgets, errors."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from opentinker.errors import EnvironmentError_
from opentinker.game import AbstractGame, StepResult, first_user_message
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.rollout.agent_loop import AgentLoop, EpisodeRequest, LoopConfig
from opentinker.services.rollout.chat_format import ChatFormat
from opentinker.services.rollout.engine import TransformersEngine
from opentinker.services.rollout.types import (
    Completion,
    FinishReason,
    ResetResult,
    StepOutcome,
    Trajectory,
)
from opentinker.spec import ModelSpec, SamplingParams

pytestmark = pytest.mark.integration


class GameSession:
    """An ``EnvSession`` that plays an ``AbstractGame`` in-process (no gRPC)."""

    def __init__(self, game: AbstractGame) -> None:
        self.game = game
        self.actions: list[str] = []
        self.closed = False

    async def reset(self, seed: int, options: Mapping[str, str]) -> ResetResult:
        observation = self.game.reset(seed=seed, **options)
        intro = self.game.get_initial_user_message()
        return ResetResult(self.game.get_system_prompt(), first_user_message(intro, observation))

    async def step(self, action: str) -> StepOutcome:
        self.actions.append(action)
        try:
            result = self.game.step(action)
        except Exception as err:
            raise EnvironmentError_(f"environment '{self.game.name}' raised: {err}") from err
        return StepOutcome(result.observation, result.reward, result.done, result.info)

    async def close(self) -> None:
        self.closed = True


class Countdown(AbstractGame):
    """Ends after ``turns`` steps (never, when 0); reward 0.25 per step; prompt from the seed."""

    name = "countdown"

    def __init__(self, turns: int = 1, fail_on_step: int = 0) -> None:
        self.turns, self.fail_on_step = turns, fail_on_step

    def get_system_prompt(self) -> str:
        return "Count down with me."

    def reset(self, *, seed: int = 0) -> str:
        self.number = random.Random(seed).randrange(1000)
        self.steps = 0
        return f"Start at {self.number}."

    def step(self, action: str) -> StepResult:
        self.steps += 1
        if self.steps == self.fail_on_step:
            raise RuntimeError("out of cheese")
        done = self.turns > 0 and self.steps >= self.turns
        return StepResult(
            observation=f"Now {self.number - self.steps}, go on.", reward=0.25, done=done
        )


class RecordingEngine:
    """The real engine, keeping every completion it returned and counting generate calls."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.inner = engine
        self.name = engine.name
        self.tokenizer = engine.tokenizer
        self.calls: list[int] = []  # batch size of each generate call
        self.completions: list[Completion] = []

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        out = self.inner.generate(prompts, sampling, seed)
        self.calls.append(len(prompts))
        self.completions.extend(out)
        return out

    def apply_weights(self, tensors, policy_version):  # noqa: ANN001, ANN201 - pass-through
        return self.inner.apply_weights(tensors, policy_version)

    def logprobs_of(self, token_ids: Sequence[int]) -> list[float]:
        return self.inner.logprobs_of(token_ids)


@pytest.fixture(scope="module")
def base_engine(tmp_path_factory: pytest.TempPathFactory) -> TransformersEngine:
    model_dir: Path = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))
    return TransformersEngine.load(
        ModelSpec(base_model=str(model_dir), finetune="full"), device="cpu"
    )


@pytest.fixture
def engine(base_engine: TransformersEngine) -> RecordingEngine:
    return RecordingEngine(base_engine)


def play(
    engine: RecordingEngine,
    sessions: list[GameSession],
    *,
    max_turns: int = 1,
    max_new_tokens: int = 8,
    max_episode_tokens: int = 512,
    seeds: list[int] | None = None,
) -> list[Trajectory]:
    config = LoopConfig(
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens),
        max_turns=max_turns,
        max_episode_tokens=max_episode_tokens,
    )
    requests = [
        EpisodeRequest(f"ep-{n}", n, (seeds or list(range(len(sessions))))[n], session)
        for n, session in enumerate(sessions)
    ]
    trajectories, stats = asyncio.run(AgentLoop(engine, config).run(requests, seed=42))  # type: ignore[arg-type]
    assert stats.generated_tokens == sum(sum(t.loss_mask) for t in trajectories)
    assert (stats.generate_seconds > 0) == (stats.generated_tokens > 0)
    assert stats.env_seconds > 0
    assert all(s.closed for s in sessions)
    return trajectories


def model_turns(t: Trajectory) -> list[list[int]]:
    """The completion split into runs of loss-mask-1 tokens (one run per model turn)."""
    completion = t.token_ids[t.prompt_length :]
    turns: list[list[int]] = []
    for i, (tok, mask) in enumerate(zip(completion, t.loss_mask, strict=True)):
        if mask == 1:
            if i == 0 or t.loss_mask[i - 1] == 0:
                turns.append([])
            turns[-1].append(tok)
    return turns


def test_single_turn_episode(engine: RecordingEngine) -> None:
    session = GameSession(Countdown(turns=1))
    [t] = play(engine, [session], seeds=[7])
    chat = ChatFormat(engine.tokenizer)
    expected_prompt = engine.tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Count down with me."},
            {"role": "user", "content": f"Start at {random.Random(7).randrange(1000)}."},
        ],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert (
        t.token_ids[: t.prompt_length]
        == expected_prompt
        == chat.prompt_ids("Count down with me.", f"Start at {random.Random(7).randrange(1000)}.")
    )
    completion = t.token_ids[t.prompt_length :]
    assert completion == engine.completions[0].token_ids
    assert t.loss_mask == [1] * len(completion)
    assert t.logprobs == engine.completions[0].logprobs and all(lp < 0 for lp in t.logprobs)
    assert 1 <= len(completion) <= 8
    assert session.actions == [engine.tokenizer.decode(completion, skip_special_tokens=True)]
    assert (t.finish_reason, t.num_turns, t.reward) == (FinishReason.ENV_DONE, 1, 0.25)
    assert t.completion_text == engine.tokenizer.decode(completion)


def test_multi_turn_masks_and_ids_come_from_the_model_and_the_template(
    engine: RecordingEngine,
) -> None:
    sessions = [GameSession(Countdown(turns=3)) for _ in range(2)]
    trajectories = play(engine, sessions, max_turns=5, max_new_tokens=6)
    chat = ChatFormat(engine.tokenizer)
    eos = engine.tokenizer.eos_token_id
    # One batched generate call per round, for both episodes.
    assert engine.calls == [2, 2, 2]
    drift = 0
    for t, session in zip(trajectories, sessions, strict=True):
        assert (t.finish_reason, t.num_turns, t.reward) == (FinishReason.ENV_DONE, 3, 0.75)
        assert len(t.logprobs) == len(t.loss_mask) == len(t.token_ids) - t.prompt_length
        turns = model_turns(t)
        assert len(turns) == 3
        # Every model turn holds exactly the sampled ids, and the env saw their decoded text.
        mine = [c.token_ids for c in engine.completions]
        assert all(turn in mine for turn in turns)
        assert session.actions == [
            engine.tokenizer.decode(x, skip_special_tokens=True) for x in turns
        ]
        drift += sum(engine.tokenizer.encode(session.actions[i]) != turns[i] for i in range(3))
        # Env tokens: loss mask 0, logprob 0, and exactly: [eos if the model did not stop] +
        # the template's ids of the next user turn.
        completion = t.token_ids[t.prompt_length :]
        position = 0
        for n, turn in enumerate(turns):
            assert completion[position : position + len(turn)] == turn
            assert t.loss_mask[position : position + len(turn)] == [1] * len(turn)
            position += len(turn)
            if n == len(turns) - 1:
                assert position == len(completion)
                break
            closing = [] if turn[-1] == eos else [eos]
            observation = closing + chat.observation_ids(
                f"Now {session.game.number - n - 1}, go on."
            )
            assert completion[position : position + len(observation)] == observation
            assert t.loss_mask[position : position + len(observation)] == [0] * len(observation)
            assert t.logprobs[position : position + len(observation)] == [0.0] * len(observation)
            # The assistant turn is closed by exactly one eos before the next user turn.
            boundary = turn + observation
            user_start = boundary.index(
                engine.tokenizer.convert_tokens_to_ids("<|im_start|>"), len(turn)
            )
            assert boundary[:user_start].count(eos) == 1
            position += len(observation)
        assert engine.tokenizer.decode(completion).count("<|im_start|>user\n") == 2
    # Random bytes from a byte-level model rarely survive decode -> encode; the ids stayed exact.
    assert drift > 0


def test_turn_budget_ends_with_max_turns(engine: RecordingEngine) -> None:
    [t] = play(engine, [GameSession(Countdown(turns=0))], max_turns=2)
    assert (t.finish_reason, t.num_turns, t.reward) == (FinishReason.MAX_TURNS, 2, 0.5)
    assert len(model_turns(t)) == 2


def test_token_budget_ends_with_max_tokens(engine: RecordingEngine) -> None:
    prompt_length = len(
        ChatFormat(engine.tokenizer).prompt_ids("Count down with me.", "Start at 1.")
    )
    budget = prompt_length + 40  # room for a turn or two, never for 10 turns of 16 tokens
    [t] = play(
        engine,
        [GameSession(Countdown(turns=0))],
        max_turns=10,
        max_new_tokens=16,
        max_episode_tokens=budget,
    )
    assert t.finish_reason is FinishReason.MAX_TOKENS
    assert len(t.token_ids) <= budget and t.num_turns < 10
    assert "max_episode_tokens" in t.finish_detail

    [short] = play(engine, [GameSession(Countdown())], max_episode_tokens=10)
    assert short.finish_reason is FinishReason.MAX_TOKENS
    assert short.num_turns == 0 and short.loss_mask == [] and "prompt" in short.finish_detail


def test_env_error_ends_only_that_episode(engine: RecordingEngine) -> None:
    broken, fine = GameSession(Countdown(turns=3, fail_on_step=2)), GameSession(Countdown(turns=3))
    bad, good = play(engine, [broken, fine], max_turns=5)
    assert bad.finish_reason is FinishReason.ENV_ERROR and "out of cheese" in bad.finish_detail
    assert bad.num_turns == 2 and bad.reward == 0.25
    assert good.finish_reason is FinishReason.ENV_DONE and good.num_turns == 3


def test_same_seed_same_trajectories(base_engine: TransformersEngine) -> None:
    first = play(
        RecordingEngine(base_engine),
        [GameSession(Countdown(turns=2)) for _ in range(3)],
        max_turns=2,
    )
    again = play(
        RecordingEngine(base_engine),
        [GameSession(Countdown(turns=2)) for _ in range(3)],
        max_turns=2,
    )
    assert [t.token_ids for t in first] == [t.token_ids for t in again]
    assert [t.logprobs for t in first] == [t.logprobs for t in again]
