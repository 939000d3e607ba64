"""The multi-agent coordinator: self-play games of an env that declares roles.

One episode (``EpisodeRequest``) is one game played by one agent per role. Each role keeps its
own token sequence, its *view*: its system prompt, the observations the env addresses to it
(loss mask 0, logprob 0) and its own turns (loss mask 1, the sampling logprobs). Another
role's turns never enter a view; the env tells each role what the others did in the
observation it addresses to it.

Phase-level synchronization: phases cycle through the roles in their declared order. In the
phase of role R, every live game whose next move is R's generates in ONE engine call (with R's
LoRA adapter active when the job trains one adapter per role: ``LoopConfig.role_adapters``),
then those games' envs step at once; a game whose turn belongs to another role waits for that
role's phase. A phase no game waits for is skipped. Every engine call is therefore
single-role, which is what lets the engine choose one adapter per call.

Rewards: each Step reply's ``role_rewards`` go to the roles they name. The acting role's share
is its new turn's reward; another role's share is added to that role's latest turn (held for
its first turn when it has none yet), so a terminal win/loss reaches the loser's last move too.
A view's ``reward`` is the sum of its ``turn_rewards``.

The result is one ``Trajectory`` per role that took at least one turn, stamped with its role
and the policy version. The game's budgets (``max_turns`` counts all roles' turns, and
``max_episode_tokens`` bounds each view) and its finish reason are shared by its views.
A failed env call ends the game with ENV_ERROR; when the env instance died (or the link to the
envs broke) the game starts over from Reset on a fresh session, at most
``max_episode_retries`` times.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from opentinker.errors import OpenTinkerError
from opentinker.services.common.tool_calls import parse_tool_calls
from opentinker.services.rollout.agent.chat_format import ChatFormat, decode
from opentinker.services.rollout.agent.env_replies import (
    reset_problem,
    restart_after,
    role_problem,
    step_problem,
)
from opentinker.services.rollout.agent.loop_config import (
    EnvSession,
    EpisodeRequest,
    LoopConfig,
    close_session,
    turn_budgets,
)
from opentinker.services.rollout.agent.multimodal import refuse_images
from opentinker.services.rollout.agent.seeds import derive_seed
from opentinker.services.rollout.engines.engine import GenerationEngine
from opentinker.services.rollout.types import (
    ChatMessage,
    Completion,
    EnvSpec,
    FinishReason,
    RolloutStats,
    StepOutcome,
    Trajectory,
)

log = structlog.get_logger("opentinker.rollout.multi_agent")


@dataclass
class RoleView:
    """One role's token sequence in one game (what its trajectory will hold)."""

    role: str
    token_ids: list[int] = field(default_factory=list)
    prompt_length: int = 0
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_start: int = 0  # where its latest model turn begins in token_ids
    num_turns: int = 0
    turn_rewards: list[float] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    held_reward: float = 0.0  # rewards that came before its first turn
    messages: list[ChatMessage] = field(default_factory=list)

    def append(self, ids: Sequence[int], logprobs: Sequence[float], mask: int) -> None:
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.loss_mask.extend([mask] * len(ids))

    def credit(self, reward: float) -> None:
        """A reward this role got from another role's step: to its latest turn."""
        if self.turn_rewards:
            self.turn_rewards[-1] += reward
        else:
            self.held_reward += reward


@dataclass
class Game:
    """One self-play episode: the views of its roles, whose move it is, how it ended."""

    request: EpisodeRequest
    session: EnvSession
    views: dict[str, RoleView] = field(default_factory=dict)
    to_move: str = ""  # the role whose view waits for a model turn; '' once over
    system_prompt: str = ""  # the reset's, for roles without one of their own
    num_turns: int = 0  # model turns of all roles
    finish_reason: FinishReason | None = None
    finish_detail: str = ""
    info: dict[str, str] = field(default_factory=dict)
    retries: int = 0
    restarts: int = 0

    def finish(self, reason: FinishReason, detail: str = "") -> None:
        self.to_move = ""
        self.finish_reason = reason
        self.finish_detail = detail


class MultiAgentLoop:
    """Plays batches of self-play games with one engine, phase by phase; knows no gRPC."""

    def __init__(
        self,
        engine: GenerationEngine,
        config: LoopConfig,
        env: EnvSpec,
        chat: ChatFormat,
        max_turns: int,
    ) -> None:
        if not env.roles:
            raise ValueError("the multi-agent loop needs an env that declares roles")
        self.engine = engine
        self.config = config
        self.env = env
        self.chat = chat
        self.max_turns = max_turns
        self.roles = env.role_names
        self._system_prompts = {role.name: role.system_prompt for role in env.roles}

    async def run(
        self, requests: Sequence[EpisodeRequest], *, seed: int
    ) -> tuple[list[Trajectory], RolloutStats]:
        """Play every game to its end; one trajectory per role that moved, game by game."""
        games = [Game(request, request.session) for request in requests]
        stats = RolloutStats()
        policy_version = self.engine.policy_version
        started = time.monotonic()
        await asyncio.gather(*(self._reset(game) for game in games))
        phase = 0
        while any(game.to_move for game in games):
            role = self.roles[phase % len(self.roles)]
            acting = [game for game in games if game.to_move == role]
            if acting:
                await self._generate(acting, role, derive_seed(seed, "phase", phase), stats)
                await asyncio.gather(*(self._interact(game, role) for game in acting))
            phase += 1
        await asyncio.gather(*(self._close(game) for game in games))
        stats.env_seconds += time.monotonic() - started - stats.generate_seconds
        stats.env_retries += sum(game.retries for game in games)
        trajectories = [
            self._trajectory(game, view, policy_version)
            for game in games
            for role in self.roles
            if (view := game.views.get(role)) is not None and view.num_turns > 0
        ]
        return trajectories, stats

    async def _reset(self, game: Game) -> None:
        try:
            reset = await game.session.reset(game.request.seed, self.config.env_options)
        except (OpenTinkerError, TimeoutError) as err:
            await self._fail(game, f"reset failed: {err}", err)
            return
        problem = reset_problem(reset, self.config.max_observation_chars) or role_problem(
            reset.next_role, self.roles, {}, next_role_due=True
        )
        if problem:
            game.finish(FinishReason.ENV_ERROR, f"bad reset reply: {problem}")
            return
        game.system_prompt = reset.system_prompt
        self._address(game, reset.next_role, reset.observation, reset.images)

    def _address(self, game: Game, role: str, observation: str, images: Sequence[object]) -> None:
        """Give ``observation`` to ``role`` as its next user turn; that role moves next. One
        that would take the view to max_episode_tokens ends the game (MAX_TOKENS) unshown."""
        try:
            refuse_images(images)  # type: ignore[arg-type]  # multi-agent envs are text-only
        except ValueError as err:
            game.finish(FinishReason.ENV_ERROR, f"bad env reply: {err}")
            return
        view = game.views.setdefault(role, RoleView(role))
        first = view.prompt_length == 0  # its first observation: its prompt
        system_prompt = (
            self._system_prompts.get(role) or game.system_prompt or self.env.system_prompt
        )
        if first:
            ids = list(self.chat.prompt_ids(system_prompt, observation))
        else:
            turn = view.token_ids[view.turn_start :]
            closing = (
                [] if turn and turn[-1] == self.chat.eos_token_id else [self.chat.eos_token_id]
            )
            ids = [*closing, *self.chat.observation_ids(observation)]
        if len(view.token_ids) + len(ids) >= self.config.max_episode_tokens:
            game.finish(
                FinishReason.MAX_TOKENS,
                f"{role}'s view has {len(view.token_ids)} tokens; the next observation "
                f"({len(ids)}) would pass max_episode_tokens={self.config.max_episode_tokens}",
            )
            return
        if first:
            if system_prompt:
                view.messages.append(ChatMessage("system", system_prompt))
            view.token_ids, view.prompt_length = ids, len(ids)
        else:
            view.append(ids, [0.0] * len(ids), mask=0)
        view.messages.append(ChatMessage("user", observation))
        game.to_move = role

    async def _generate(self, games: list[Game], role: str, seed: int, stats: RolloutStats) -> None:
        """One engine call for the acting role of every game in this phase."""
        views = [game.views[role] for game in games]
        limits, sampling = turn_budgets(self.config, [len(v.token_ids) for v in views])
        options: dict[str, object] = {}
        if self.config.greedy:
            options["greedy"] = True
        if self.config.role_adapters:  # only then: engines without named adapters still serve
            options["adapter"] = role
        prompts = [v.token_ids for v in views]
        started = time.monotonic()
        completions: list[Completion] = await asyncio.to_thread(
            lambda: self.engine.generate(prompts, sampling, seed, **options)  # type: ignore[arg-type]
        )
        stats.generate_seconds += time.monotonic() - started
        for game, view, completion, limit in zip(games, views, completions, limits, strict=True):
            ids, logprobs = completion.token_ids[:limit], completion.logprobs[:limit]
            view.turn_start = len(view.token_ids)
            view.append(ids, logprobs, mask=1)
            view.num_turns += 1
            game.num_turns += 1
            stats.generated_tokens += len(ids)

    async def _step(self, game: Game, action: str) -> StepOutcome:
        """Step with the turn's raw text; an env with tools also gets the parsed calls (as
        the one-agent loop gives them; the prompts show every role the tools)."""
        if not self.env.tools:
            return await game.session.step(action)
        names = frozenset(t.name for t in self.env.tools)
        return await game.session.step(
            action, parse_tool_calls(action, names, self.chat.tool_call_style)
        )

    async def _interact(self, game: Game, role: str) -> None:
        view = game.views[role]
        action = self._decode(view.token_ids[view.turn_start :], skip_special_tokens=True)
        view.messages.append(ChatMessage("assistant", action))
        try:
            outcome = await self._step(game, action)
        except (OpenTinkerError, TimeoutError) as err:
            what = f"step {game.num_turns} ({role}) failed: {err}"
            await self._fail(game, what, err, stepping=True)
            return
        problem = step_problem(outcome, self.config.max_observation_chars) or role_problem(
            outcome.next_role, self.roles, outcome.role_rewards, next_role_due=not outcome.done
        )
        if problem:
            game.finish(FinishReason.ENV_ERROR, f"bad reply to step {game.num_turns}: {problem}")
            return
        self._reward(game, view, outcome)
        game.info = dict(outcome.info)
        if outcome.done:
            game.finish(FinishReason.ENV_DONE)
            return
        if game.num_turns >= self.max_turns:
            game.finish(FinishReason.MAX_TURNS, f"{game.num_turns} turns of all roles")
            return
        self._address(game, outcome.next_role, outcome.observation, outcome.images)

    def _reward(self, game: Game, acting: RoleView, outcome: StepOutcome) -> None:
        """The acting role's reward is its turn's; the others' go to their latest turns."""
        acting.turn_rewards.append(outcome.role_rewards.get(acting.role, 0.0) + acting.held_reward)
        acting.held_reward = 0.0
        acting.turn_ends.append(len(acting.token_ids) - acting.prompt_length)
        for role, reward in outcome.role_rewards.items():
            if role != acting.role:
                view = game.views.setdefault(role, RoleView(role))
                view.credit(reward)

    async def _fail(
        self, game: Game, what: str, err: OpenTinkerError | TimeoutError, *, stepping: bool = False
    ) -> None:
        """End the game with ENV_ERROR, or play it again from Reset when its env died (or,
        ``stepping``, lost it)."""
        reopen = game.request.reopen
        kind, why = restart_after(err, game, self.config, stepping=stepping)
        if not kind or reopen is None:
            game.finish(FinishReason.ENV_ERROR, f"{what}{why}")
            return
        await self._close(game)
        game.restarts += 1
        game.retries += kind == "env"
        env_episode_id = f"{game.request.episode_id}-r{game.restarts}"
        log.warning("game_restarting", episode_id=game.request.episode_id, error=str(err))
        game.session = reopen(env_episode_id)
        game.views, game.to_move, game.num_turns, game.info = {}, "", 0, {}
        await self._reset(game)

    async def _close(self, game: Game) -> None:
        await close_session(game.session, game.request.episode_id)

    def _decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
        return decode(self.engine.tokenizer, ids, skip_special_tokens=skip_special_tokens)

    def _trajectory(self, game: Game, view: RoleView, policy_version: int) -> Trajectory:
        assert game.finish_reason is not None, "every game ends with a reason"
        return Trajectory(
            episode_id=game.request.episode_id,
            group_index=game.request.group_index,
            token_ids=view.token_ids,
            prompt_length=view.prompt_length,
            logprobs=view.logprobs,
            loss_mask=view.loss_mask,
            reward=sum(view.turn_rewards),
            num_turns=view.num_turns,
            finish_reason=game.finish_reason,
            finish_detail=game.finish_detail,
            completion_text=self._decode(
                view.token_ids[view.prompt_length :], skip_special_tokens=False
            ),
            policy_version=policy_version,
            info=game.info,
            env_retries=game.retries,
            messages=view.messages,
            turn_rewards=list(view.turn_rewards),
            turn_ends=list(view.turn_ends),
            role=view.role,
        )
