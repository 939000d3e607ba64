"""The agent loop on the tiny model against in-process games: masks, ids, budgets, errors."""

from __future__ import annotations

import asyncio
import copy
import math
import random

import pytest
from agent_loop_helpers import Countdown, GameSession, RecordingEngine, model_turns, play

from opentinker.errors import EnvironmentError_
from opentinker.game import AbstractGame, StepResult
from opentinker.services.rollout.agent.agent_loop import AgentLoop
from opentinker.services.rollout.agent.chat_format import ChatFormat
from opentinker.services.rollout.agent.env_replies import EnvLinkLostError
from opentinker.services.rollout.agent.loop_config import EpisodeRequest, LoopConfig
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.types import (
    FinishReason,
    StepOutcome,
    Trajectory,
)
from opentinker.spec import SamplingParams

pytestmark = pytest.mark.integration


@pytest.fixture
def engine(base_engine: TransformersEngine) -> RecordingEngine:
    return RecordingEngine(base_engine)


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


# A template that renders an assistant message differently when it is the last one, as
# Qwen3's hybrid-thinking template does (an empty think block only there)
QWEN3_LIKE_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and loop.last and not add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_observation_turns_with_a_template_that_renders_the_last_assistant_apart(
    engine: RecordingEngine,
) -> None:
    """Such a template failed the check that earlier turns render alike, so every multi-turn
    episode of a Qwen3 model ended ENV_ERROR ("bad reply to step 1"), the env blamed. The
    observation's ids come from one rendering now: those of ChatML's."""
    thinking = copy.deepcopy(engine.tokenizer)
    thinking.chat_template = QWEN3_LIKE_TEMPLATE
    closed = thinking.apply_chat_template(
        [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], tokenize=False
    )
    assert "<think>" in closed  # the last assistant message is rendered apart
    ids = ChatFormat(thinking).observation_ids("Now 2, go on.")
    assert ids == ChatFormat(engine.tokenizer).observation_ids("Now 2, go on.")
    assert (
        thinking.decode(ids)
        == "\n<|im_start|>user\nNow 2, go on.<|im_end|>\n<|im_start|>assistant\n"
    )


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


class Reporting(Countdown):
    """Countdown whose steps report their count in info; its last step may reply badly.

    intro: "" = the usual first observation, "-" = none (and no system prompt), else this text.
    """

    def __init__(self, turns: int, last: StepResult | None = None, intro: str = "") -> None:
        super().__init__(turns=turns)
        self.last, self.intro = last, intro

    def get_system_prompt(self) -> str:
        return "" if self.intro == "-" else super().get_system_prompt()

    def reset(self, *, seed: int = 0) -> str:
        observation = super().reset(seed=seed)
        return {"": observation, "-": ""}.get(self.intro, self.intro)

    def step(self, action: str) -> StepResult:
        result = super().step(action)
        if self.last is not None and result.done:
            return self.last
        return StepResult(
            result.observation, result.reward, result.done, {"steps": str(self.steps)}
        )


class DyingSession(GameSession):
    """A session whose env instance dies (UNAVAILABLE) at step ``die_on_step``."""

    def __init__(self, game: AbstractGame, die_on_step: int, code: str = "UNAVAILABLE") -> None:
        super().__init__(game)
        self.die_on_step, self.code = die_on_step, code

    async def step(self, action: str) -> StepOutcome:
        if len(self.actions) + 1 == self.die_on_step:
            self.actions.append(action)
            raise EnvironmentError_("instance 10.0.0.1:7 went away", code=self.code)
        return await super().step(action)


def play_requests(
    engine: RecordingEngine, requests: list[EpisodeRequest], **config: int
) -> list[Trajectory]:
    loop_config = LoopConfig(
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6),
        max_turns=config.pop("max_turns", 5),
        max_episode_tokens=512,
        **config,
    )
    trajectories, stats = asyncio.run(AgentLoop(engine, loop_config).run(requests, seed=3))  # type: ignore[arg-type]
    assert stats.env_retries == sum(t.env_retries for t in trajectories)
    return trajectories


def test_info_of_the_last_step_and_the_messages_are_kept(engine: RecordingEngine) -> None:
    session = GameSession(Reporting(turns=3))
    [t] = play(engine, [session], max_turns=5, seeds=[11])
    assert t.info == {"steps": "3"} and t.env_retries == 0
    start = random.Random(11).randrange(1000)
    assert [(m.role, m.content) for m in t.messages] == [
        ("system", "Count down with me."),
        ("user", f"Start at {start}."),
        ("assistant", session.actions[0]),
        ("user", f"Now {start - 1}, go on."),
        ("assistant", session.actions[1]),
        ("user", f"Now {start - 2}, go on."),
        ("assistant", session.actions[2]),
    ]


def test_an_episode_whose_instance_died_starts_over_from_reset(engine: RecordingEngine) -> None:
    opened: list[str] = []
    replacements: list[GameSession] = []

    def reopen(env_episode_id: str) -> GameSession:
        opened.append(env_episode_id)
        replacements.append(GameSession(Reporting(turns=3)))
        return replacements[-1]

    dying = DyingSession(Reporting(turns=3), die_on_step=2)
    [t, clean] = play_requests(
        engine,
        [
            EpisodeRequest("ep-0", 0, 9, dying, reopen),
            EpisodeRequest("ep-1", 1, 9, GameSession(Reporting(turns=3))),
        ],
    )
    assert opened == ["ep-0-r1"] and dying.closed and replacements[0].closed
    assert (t.finish_reason, t.env_retries, t.num_turns, t.reward) == (
        FinishReason.ENV_DONE,
        1,
        3,
        0.75,
    )
    # The restart played from a fresh reset with the same seed: same prompt, only new turns.
    assert t.token_ids[: t.prompt_length] == clean.token_ids[: clean.prompt_length]
    assert len(replacements[0].actions) == 3 and t.info == {"steps": "3"}
    assert [m.role for m in t.messages].count("assistant") == 3
    assert len(t.loss_mask) == len(t.token_ids) - t.prompt_length == len(t.logprobs)


class LinkLostSession(GameSession):
    """A session whose link to the envs (EnvHub) breaks at step ``lost_on_step``."""

    def __init__(self, game: AbstractGame, lost_on_step: int) -> None:
        super().__init__(game)
        self.lost_on_step = lost_on_step

    async def step(self, action: str) -> StepOutcome:
        if len(self.actions) + 1 == self.lost_on_step:
            self.actions.append(action)
            raise EnvLinkLostError("EnvHub at 127.0.0.1:9 went away", code="UNAVAILABLE")
        return await super().step(action)


def test_a_lost_link_restarts_the_episode_without_using_its_retries(
    engine: RecordingEngine,
) -> None:
    opened: list[str] = []

    def reopen(env_episode_id: str) -> GameSession:
        opened.append(env_episode_id)
        if len(opened) == 1:  # the link breaks once more, then the env instance dies
            return LinkLostSession(Reporting(turns=3), lost_on_step=1)
        if len(opened) == 2:
            return DyingSession(Reporting(turns=3), die_on_step=1)
        return GameSession(Reporting(turns=3))

    [t] = play_requests(
        engine,
        [EpisodeRequest("ep-0", 0, 9, LinkLostSession(Reporting(turns=3), 2), reopen)],
        max_episode_retries=1,
    )
    # Two link losses and one env failure: three restarts, one of the env's budget of 1.
    assert opened == ["ep-0-r1", "ep-0-r2", "ep-0-r3"]
    assert (t.finish_reason, t.env_retries, t.num_turns, t.reward) == (
        FinishReason.ENV_DONE,
        1,
        3,
        0.75,
    )


def test_a_link_that_keeps_breaking_ends_the_episode(engine: RecordingEngine) -> None:
    opened: list[str] = []

    def reopen(env_episode_id: str) -> GameSession:
        opened.append(env_episode_id)
        return LinkLostSession(Reporting(turns=3), lost_on_step=1)

    [t] = play_requests(
        engine,
        [EpisodeRequest("ep-0", 0, 9, LinkLostSession(Reporting(turns=3), 1), reopen)],
        max_link_restarts=2,
    )
    assert opened == ["ep-0-r1", "ep-0-r2"]
    assert (t.finish_reason, t.env_retries) == (FinishReason.ENV_ERROR, 0)
    assert "EnvHub at 127.0.0.1:9 went away" in t.finish_detail
    assert "the link to the envs was lost 3 times" in t.finish_detail


def test_restarts_are_bounded_and_only_for_a_dead_instance(engine: RecordingEngine) -> None:
    def always_dying(env_episode_id: str) -> GameSession:
        return DyingSession(Reporting(turns=3), die_on_step=1)

    def never(env_episode_id: str) -> GameSession:
        raise AssertionError("an env's own error must not restart the episode")

    doomed, own_fault, deadline = play_requests(
        engine,
        [
            EpisodeRequest("a", 0, 1, DyingSession(Reporting(turns=3), 1), always_dying),
            EpisodeRequest("b", 1, 2, DyingSession(Reporting(turns=3), 1, code="INTERNAL"), never),
            EpisodeRequest("c", 2, 3, DyingSession(Reporting(turns=3), 2, "DEADLINE_EXCEEDED")),
        ],
        max_episode_retries=2,
    )
    assert (doomed.finish_reason, doomed.env_retries) == (FinishReason.ENV_ERROR, 2)
    assert "gave up after 2 restarts" in doomed.finish_detail
    assert "went away" in doomed.finish_detail
    assert (own_fault.finish_reason, own_fault.env_retries) == (FinishReason.ENV_ERROR, 0)
    # No reopen given: a dead instance ends the episode at once.
    assert (deadline.finish_reason, deadline.env_retries, deadline.num_turns) == (
        FinishReason.ENV_ERROR,
        0,
        2,
    )


def test_bad_env_replies_end_only_their_episode_with_a_reason(engine: RecordingEngine) -> None:
    nan, inf, beyond, huge, empty, fine, big_prompt = play_requests(
        engine,
        [
            EpisodeRequest("nan", 0, 1, GameSession(Reporting(2, StepResult("", math.nan, True)))),
            EpisodeRequest("inf", 1, 1, GameSession(Reporting(1, StepResult("", -math.inf, True)))),
            # Finite, but inf as the float32 the trainer gets it in: its advantages were NaN
            EpisodeRequest("1e39", 6, 1, GameSession(Reporting(1, StepResult("", 1e39, True)))),
            EpisodeRequest("huge", 2, 1, GameSession(Reporting(1, StepResult("x" * 101, 1, True)))),
            EpisodeRequest("empty", 3, 1, GameSession(Reporting(1, intro="-"))),
            EpisodeRequest("fine", 4, 1, GameSession(Reporting(2))),
            EpisodeRequest("prompt", 5, 1, GameSession(Reporting(1, intro="y" * 101))),
        ],
        max_observation_chars=100,
    )
    assert all(
        t.finish_reason is FinishReason.ENV_ERROR
        for t in (nan, inf, beyond, huge, empty, big_prompt)
    )
    assert "non-finite reward (nan)" in nan.finish_detail and nan.num_turns == 2
    assert "non-finite reward (-inf)" in inf.finish_detail
    assert "reward 1e+39 is beyond ±1e+30" in beyond.finish_detail
    assert (
        "101 characters" in huge.finish_detail and "max_observation_chars=100" in huge.finish_detail
    )
    assert "missing fields" in empty.finish_detail and empty.num_turns == 0
    assert "reset observation has 101 characters" in big_prompt.finish_detail
    assert (fine.finish_reason, fine.num_turns, fine.info) == (
        FinishReason.ENV_DONE,
        2,
        {"steps": "2"},
    )
