"""Multi-agent self-play: the rollout's coordinator playing many games phase by phase with the
tiny model (each role's own tokens, masks and rewards), and the two-role gomoku env through a
real EnvHub. The two-role gomoku env's own rules: test_gomoku_env.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from agent_loop_helpers import RoleSession, model_turns

from opentinker.errors import UnavailableError
from opentinker.game import AbstractGame, Role, StepResult
from opentinker.rollout.v1 import rollout_pb2
from opentinker.services.envhub.server import EnvHubDeps
from opentinker.services.envhub.server import create_server as create_envhub
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.rollout.agent.agent_loop import AgentLoop
from opentinker.services.rollout.agent.loop_config import EpisodeRequest, LoopConfig
from opentinker.services.rollout.config import RolloutConfig
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.inference import run_inference
from opentinker.services.rollout.session import RolloutSession
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.rollout.types import (
    Completion,
    EnvSpec,
    FinishReason,
    RoleSpec,
    StepOutcome,
)
from opentinker.services.rollout.wire import trajectory_to_proto
from opentinker.spec import ModelSpec, SamplingParams


class Relay(AbstractGame):
    """Two roles take turns saying anything; a turn whose text has an odd length is refused
    and its role goes again (so games fall out of step). After ``turns`` accepted turns each
    role is paid the share of accepted turns that were its own."""

    name = "relay"
    roles = (Role("left", "You are LEFT."), Role("right", "You are RIGHT."))

    def __init__(self, turns: int = 4) -> None:
        self.turns = turns

    def get_system_prompt(self) -> str:
        return ""

    def reset(self, *, seed: int = 0) -> str:
        self.to_move, self.accepted = "left", {"left": 0, "right": 0}
        self.heard: list[tuple[str, str]] = []
        return f"Game {seed}: you start."

    def first_role(self) -> str:
        return self.to_move

    def step(self, action: str) -> StepResult:
        role = self.to_move
        self.heard.append((role, action))
        if len(action) % 2 == 1:
            return StepResult("Odd; again.", -0.5, False, next_role=role, role_rewards={role: -0.5})
        self.accepted[role] += 1
        total = sum(self.accepted.values())
        if total >= self.turns:
            rewards = {r: n / total for r, n in self.accepted.items()}
            return StepResult(
                "Over.", rewards[role], True, {"total": str(total)}, role_rewards=rewards
            )
        self.to_move = "right" if role == "left" else "left"
        return StepResult(
            f"The other said {len(action)} characters.", 0.0, False, next_role=self.to_move
        )


class PhaseEngine:
    """The real engine, recording each call's batch size and adapter (the role it served)."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.inner, self.name, self.tokenizer = engine, engine.name, engine.tokenizer
        self.calls: list[tuple[int, str | None]] = []

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        seed: int,
        *,
        adapter: str | None = None,
    ) -> list[Completion]:
        self.calls.append((len(prompts), adapter))
        return self.inner.generate(prompts, sampling, seed)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> TransformersEngine:
    return TransformersEngine.load(
        ModelSpec(base_model=str(model_dir), finetune="full"), device="cpu"
    )


@pytest.mark.integration
def test_two_roles_play_many_games_each_on_its_own_tokens(engine: TransformersEngine) -> None:
    games = 32
    sessions = [RoleSession(Relay()) for _ in range(games)]
    spec = EnvSpec(
        name="relay", roles=(RoleSpec("left", "You are LEFT."), RoleSpec("right", "You are RIGHT."))
    )
    config = LoopConfig(
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6),
        max_turns=30,
        max_episode_tokens=1024,
        role_adapters=True,
    )
    recording = PhaseEngine(engine)
    requests = [EpisodeRequest(f"g{n}", n, n, s) for n, s in enumerate(sessions)]
    loop = AgentLoop(recording, config, spec)  # type: ignore[arg-type]
    trajectories, stats = asyncio.run(loop.run(requests, seed=7))

    assert all(s.closed for s in sessions)
    assert len(trajectories) == 2 * games  # one per role per game (both roles moved in each)
    # Phase-level synchronization: every engine call served one role, alternating, and the
    # first phases held every game (all start with left, then all go right).
    assert recording.calls[0] == (games, "left")
    assert {adapter for _, adapter in recording.calls} == {"left", "right"}
    assert sum(size for size, _ in recording.calls) == sum(t.num_turns for t in trajectories)
    assert stats.generated_tokens == sum(sum(t.loss_mask) for t in trajectories)
    tok = engine.tokenizer
    for n, session in enumerate(sessions):
        game = session.game
        assert isinstance(game, Relay)
        by_role = {t.role: t for t in trajectories if t.episode_id == f"g{n}"}
        assert set(by_role) == {"left", "right"}
        for role, t in by_role.items():
            assert t.finish_reason is FinishReason.ENV_DONE and t.group_index == n
            assert len(t.loss_mask) == len(t.logprobs) == len(t.token_ids) - t.prompt_length
            prompt = tok.decode(t.token_ids[: t.prompt_length])
            assert f"You are {role.upper()}." in prompt
            first = f"Game {n}: you start." if role == "left" else "The other said"
            assert first in prompt
            # Its mask-1 runs are exactly the actions the env got from this role, in order;
            # the other role's turns never appear in its view.
            own = [a for r, a in game.heard if r == role]
            turns = [tok.decode(ids, skip_special_tokens=True) for ids in model_turns(t)]
            assert turns == own, (role, turns, own)
            completion = tok.decode(t.token_ids[t.prompt_length :], skip_special_tokens=True)
            assert t.num_turns == len(own) == len(t.turn_rewards) == len(t.turn_ends)
            assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m == 0)
            # Its rewards: -0.5 per refused turn, then its share of the accepted turns.
            share = game.accepted[role] / sum(game.accepted.values())
            refused = sum(1 for a in own if len(a) % 2 == 1)
            assert t.reward == pytest.approx(share - 0.5 * refused)
            assert sum(t.turn_rewards) == pytest.approx(t.reward)
            assert "Over." not in completion  # the last observation is never appended


@pytest.mark.integration
def test_no_role_view_grows_past_max_episode_tokens(engine: TransformersEngine) -> None:
    """A game whose next observation would take a view past max_episode_tokens ends
    MAX_TOKENS without it, as a single-agent episode does: every view stays within the budget
    (the trainer's micro_batch_tokens is sized by it) and ends with its role's own turn."""
    budget = 72
    sessions = [RoleSession(Relay(turns=40)) for _ in range(8)]
    spec = EnvSpec(name="relay", roles=(RoleSpec("left", "L."), RoleSpec("right", "R.")))
    config = LoopConfig(
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6),
        max_turns=40,
        max_episode_tokens=budget,
    )
    requests = [EpisodeRequest(f"g{n}", n, n, s) for n, s in enumerate(sessions)]
    trajectories, _ = asyncio.run(AgentLoop(engine, config, spec).run(requests, seed=3))  # type: ignore[arg-type]
    ended = {t.episode_id: t.finish_reason for t in trajectories}
    assert set(ended.values()) == {FinishReason.MAX_TOKENS}, ended
    for t in trajectories:
        assert len(t.token_ids) <= budget, (t.episode_id, t.role, len(t.token_ids))
        assert t.loss_mask[-1] == 1, (t.episode_id, t.role)
        assert len(t.loss_mask) == len(t.logprobs) == len(t.token_ids) - t.prompt_length


async def collect_selfplay(engine: TransformersEngine, env_options: dict[str, str]) -> list:
    """One batch of the built-in ``gomoku_selfplay`` through a real EnvHub (gRPC), as the
    trainer receives it (the rollout's protobuf trajectories)."""
    settings = EnvHubSettings(port=0, builtin_envs=["gomoku_selfplay"])
    deps = EnvHubDeps.create(settings)
    server, port = await create_envhub(settings, deps)
    try:
        session = RolloutSession(
            RolloutSettings(envhub_address=f"127.0.0.1:{port}", device="cpu", env_timeout_s=10.0),
            lambda spec: engine,
        )
        await session.open(
            RolloutConfig(
                job_id="selfplay",
                model=ModelSpec(base_model="preloaded", finetune="full"),
                env_name="gomoku_selfplay",
                env_options=env_options,
                sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6),
                max_turns=6,
                max_episode_tokens=2048,
            )
        )
        batch = await session.collect(0, num_groups=4, group_size=2)
        return [trajectory_to_proto(t) for t in batch.trajectories]
    finally:
        await server.stop(0)
        await deps.close()


@pytest.mark.integration
def test_gomoku_selfplay_through_envhub_gives_each_role_its_trajectory(
    engine: TransformersEngine,
) -> None:
    # The untrained model writes no legal move: invalid_move=random plays one for it.
    trajectories = asyncio.run(collect_selfplay(engine, {"invalid_move": "random"}))
    tok = engine.tokenizer
    games = {t.episode_id for t in trajectories}
    assert len(games) == 8 and len(trajectories) == 16
    for game in games:
        views = {t.role: t for t in trajectories if t.episode_id == game}
        assert set(views) == {"black", "white"}
        black, white = views["black"], views["white"]
        assert "as black (X)" in tok.decode(black.token_ids[: black.prompt_length])
        prompt = tok.decode(white.token_ids[: white.prompt_length])
        assert "as white (O)" in prompt and "Black (X) played" in prompt
        # The budget counts both roles' turns: 3 each, alternating.
        assert black.num_turns == white.num_turns == 3
        assert all(t.finish_reason == rollout_pb2.FINISH_REASON_MAX_TURNS for t in views.values())
        # Each view holds its own 3 turns at mask 1 and the other's moves only as text.
        for view, other, own in (
            (white, "Black (X)", "white, O"),
            (black, "White (O)", "black, X"),
        ):
            text = tok.decode(view.token_ids[view.prompt_length :])
            assert text.count(f"{other} played") == 2 and text.count(f"Your move ({own})") == 2


@pytest.mark.integration
def test_gomoku_against_the_heuristic_plays_only_the_agent_role(engine: TransformersEngine) -> None:
    trajectories = asyncio.run(collect_selfplay(engine, {"heuristic_plays": "alternate"}))
    assert len(trajectories) == 8  # one agent per game: the heuristic role has no trajectory
    for t in trajectories:
        assert t.role in {"black", "white"} and t.info["heuristic_role"] != t.role


class Careless(Relay):
    """A Relay whose step names no next role on seed 1 and pays an unknown role on seed 2."""

    def reset(self, *, seed: int = 0) -> str:
        self.seed = seed
        return super().reset(seed=seed)

    def step(self, action: str) -> StepResult:
        if self.seed == 1:
            return StepResult("Who's next?", 0.0, False)
        if self.seed == 2:
            return StepResult("Over.", 0.0, True, role_rewards={"referee": 1.0})
        return StepResult("Over.", 1.0, True, role_rewards={"left": 1.0})


@pytest.mark.integration
def test_bad_multi_agent_replies_end_only_their_game_with_a_reason(
    engine: TransformersEngine,
) -> None:
    sessions = [RoleSession(Careless()) for _ in range(3)]
    spec = EnvSpec(name="careless", roles=(RoleSpec("left"), RoleSpec("right")))
    config = LoopConfig(
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4),
        max_turns=4,
        max_episode_tokens=512,
    )
    requests = [EpisodeRequest(f"c{n}", n, n, s) for n, s in enumerate(sessions)]
    trajectories, _ = asyncio.run(AgentLoop(engine, config, spec).run(requests, seed=1))  # type: ignore[arg-type]
    by_game = {t.episode_id: t for t in trajectories}
    assert set(by_game) == {"c0", "c1", "c2"} and all(t.role == "left" for t in trajectories)
    assert by_game["c0"].finish_reason is FinishReason.ENV_DONE and by_game["c0"].reward == 1.0
    assert by_game["c1"].finish_reason is FinishReason.ENV_ERROR
    assert "names no next_role" in by_game["c1"].finish_detail
    assert by_game["c2"].finish_reason is FinishReason.ENV_ERROR
    assert "'referee'" in by_game["c2"].finish_detail


@pytest.mark.integration
def test_inference_on_a_selfplay_env_writes_a_row_per_role(model_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "selfplay.jsonl"
    seen: list[tuple[int, int]] = []

    async def scenario() -> None:
        settings = EnvHubSettings(port=0, builtin_envs=["gomoku_selfplay"])
        deps = EnvHubDeps.create(settings)
        server, port = await create_envhub(settings, deps)
        try:
            await asyncio.to_thread(
                run_inference,
                model=str(model_dir),
                env_name="gomoku_selfplay",
                envhub_address=f"127.0.0.1:{port}",
                episodes=2,
                output=output,
                env_options={"invalid_move": "random"},
                sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4),
                max_turns=4,
                seed=1,
                device="cpu",
                progress=lambda done, total: seen.append((done, total)),
            )
        finally:
            await server.stop(0)
            await deps.close()

    asyncio.run(asyncio.wait_for(scenario(), 120))
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted((r["episode_id"][-2:], r["role"]) for r in rows) == [
        ("e0", "black"),
        ("e0", "white"),
        ("e1", "black"),
        ("e1", "white"),
    ]
    assert seen[-1] == (2, 2)


class DyingRoleSession(RoleSession):
    """A role session whose env instance dies (UNAVAILABLE) at its ``die_on_step``-th step."""

    def __init__(self, game: AbstractGame, die_on_step: int) -> None:
        super().__init__(game)
        self.die_on_step, self.steps = die_on_step, 0

    async def step(self, action: str) -> StepOutcome:
        self.steps += 1
        if self.steps == self.die_on_step:
            raise UnavailableError("env instance going away", code="UNAVAILABLE")
        return await super().step(action)


@pytest.mark.integration
def test_a_game_whose_instance_died_is_played_again_from_reset(
    engine: TransformersEngine,
) -> None:
    opened: list[str] = []
    fresh: list[RoleSession] = []

    def reopen(env_episode_id: str) -> RoleSession:
        opened.append(env_episode_id)
        fresh.append(RoleSession(Relay(turns=2)))
        return fresh[-1]

    dying = DyingRoleSession(Relay(turns=2), die_on_step=2)
    spec = EnvSpec(name="relay", roles=(RoleSpec("left"), RoleSpec("right")))
    config = LoopConfig(
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4),
        max_turns=12,
        max_episode_tokens=1024,
    )
    request = EpisodeRequest("g", 0, 5, dying, reopen)
    trajectories, stats = asyncio.run(AgentLoop(engine, config, spec).run([request], seed=3))  # type: ignore[arg-type]
    assert opened == ["g-r1"] and dying.closed and fresh[0].closed and stats.env_retries == 1
    assert {t.role for t in trajectories} == {"left", "right"}
    game = fresh[0].game
    assert isinstance(game, Relay)
    tok = engine.tokenizer
    for t in trajectories:  # only the replayed game's turns, none of the lost one's
        assert t.finish_reason is FinishReason.ENV_DONE and t.env_retries == 1
        turns = [tok.decode(ids, skip_special_tokens=True) for ids in model_turns(t)]
        assert turns == [a for r, a in game.heard if r == t.role]
