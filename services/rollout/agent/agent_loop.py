"""The agent loop: episodes against environments, batched generation, token-exact records.

Each episode moves through PENDING (reset; the prompt is tokenized with the chat template)
-> GENERATING (model tokens: loss mask 1, logprobs kept) -> INTERACTING (the env steps with
this turn's text; a next observation is appended as ids of a new user turn: loss mask 0,
logprob 0) -> GENERATING ... -> TERMINATED, when the env says done or the turn or token
budget ends. With ``scheduling="async"`` (the default) every episode goes back to generation
as soon as its env replied and each engine call samples the episodes ready then (see
``episode_scheduler``); with ``"lockstep"`` all GENERATING episodes of a round are sampled in
one engine call, then all their envs step.
The turn budget is the job's max_turns, else the env's own (``turn_limit``). An env's tools
are rendered into the prompt by the chat template; each turn of an env with tools is sent as
its raw text together with the tool calls parsed from it (``tool_calls``).

An env failure ends the episode with ENV_ERROR and the reason, except when the env instance
died (UNAVAILABLE / DEADLINE_EXCEEDED) or lost the episode (a Step answered NOT_FOUND: the
server restarted at its address, say): then the episode starts over from Reset with the same
seed, on a fresh env session (a new episode id), up to ``max_episode_retries`` times; when the
rollout's link to the envs itself broke (``EnvLinkLostError``: EnvHub died), the episode starts
over the same way without using that budget (the fresh session waits for the link; at most
``max_link_restarts`` times, for a link that keeps breaking or cannot mend). Replies
that cannot be used (non-finite reward, an observation over ``max_observation_chars``,
missing fields) end the episode with ENV_ERROR; the other episodes go on.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence

import structlog

from opentinker.errors import OpenTinkerError
from opentinker.services.common.tool_calls import parse_tool_calls
from opentinker.services.rollout.agent.chat_format import ChatFormat, decode
from opentinker.services.rollout.agent.env_replies import reset_problem, restart_after, step_problem
from opentinker.services.rollout.agent.episode_record import (
    EpisodeState,
    PlayedEpisode,
    ResetEpisodes,
)
from opentinker.services.rollout.agent.episode_scheduler import EpisodeScheduler, EpisodeSteps
from opentinker.services.rollout.agent.loop_config import (
    EnvSession,
    EpisodeRequest,
    LoopConfig,
    close_session,
    turn_budgets,
    turn_limit,
)
from opentinker.services.rollout.agent.multi_agent import MultiAgentLoop
from opentinker.services.rollout.agent.multimodal import (
    observation_ids_with_images,
    prompt_ids_with_images,
    vision_chat_for,
)
from opentinker.services.rollout.agent.seeds import derive_seed
from opentinker.services.rollout.agent_endpoint.episodes import AgentProgramLoop
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

log = structlog.get_logger("opentinker.rollout.agent_loop")


class AgentLoop:
    """Plays batches of episodes with one engine; knows nothing of gRPC."""

    def __init__(
        self, engine: GenerationEngine, config: LoopConfig, env: EnvSpec | None = None
    ) -> None:
        """env: the spec of the environment played (its turn limit, its tools)."""
        self.engine = engine
        self.config = config
        self.env = env or EnvSpec()
        self.max_turns = turn_limit(config.max_turns, self.env.max_turns)
        self.chat = ChatFormat(engine.tokenizer, self.env.tools)
        self.vision = vision_chat_for(engine, self.env.tools)  # None: a text-only model
        self._tool_names = frozenset(t.name for t in self.env.tools)
        # An env with roles: self-play games, phase by phase (multi_agent.py).
        self.multi_agent = (
            MultiAgentLoop(engine, config, self.env, self.chat, self.max_turns)
            if self.env.roles
            else None
        )
        # A job with an agent program: it plays each episode through the endpoint; its model
        # calls are capped by the job's max_turns (the env's own limit counts env steps).
        self.agent_programs = (
            AgentProgramLoop(engine, config, config.agent, turn_limit(config.max_turns, 0))
            if config.agent
            else None
        )
        if self.env.tools and not self.chat.renders_tools():
            log.warning(
                "tools_not_rendered",
                env=self.env.name,
                tools=sorted(self._tool_names),
                reason="the model's chat template ignores tools=; the model is not shown them",
            )

    async def reset_ahead(
        self, requests: Sequence[EpisodeRequest], *, limit: int | None = None
    ) -> ResetEpisodes:
        """Reset the episodes of ``requests`` (the first ``limit`` of them) now, for a later
        ``run`` to play (a Reset needs no weights: the rollout does it while the trainer
        updates; batch_ahead.py). An episode whose env is at capacity is not failed: it stays
        PENDING and is reset when played, once the played episodes free their slots."""
        episodes = [PlayedEpisode(request, request.session) for request in requests]
        if self.agent_programs is not None:  # its episodes reset when their program starts
            return ResetEpisodes(episodes, 0)
        tried = len(episodes) if limit is None else min(limit, len(episodes))
        await asyncio.gather(*(self._reset(ep, ahead=True) for ep in episodes[:tried]))
        return ResetEpisodes(episodes, tried)

    async def close_unplayed(self, ready: ResetEpisodes) -> None:
        """End the env sessions of episodes reset ahead that will not be played."""
        await asyncio.gather(*(self._close(ep) for ep in ready.episodes))

    async def run(
        self,
        requests: Sequence[EpisodeRequest] | ResetEpisodes,
        *,
        seed: int,
        every_segment: bool = False,
    ) -> tuple[list[Trajectory], RolloutStats]:
        """Play every episode to the end (``ResetEpisodes``: from their reset ahead); ``seed``
        fixes the sampling of every round. ``every_segment`` (training): an agent-program
        episode whose conversation the agent rewrote gives a trajectory per token segment.

        An env with roles plays each episode as a self-play game: one trajectory per role."""
        if self.agent_programs is not None:
            if isinstance(requests, ResetEpisodes):
                requests = [ep.request for ep in requests.episodes]
            return await self.agent_programs.run(requests, seed=seed, every_segment=every_segment)
        if isinstance(requests, ResetEpisodes):
            episodes = requests.episodes
        elif self.multi_agent is not None:
            return await self.multi_agent.run(requests, seed=seed)
        else:
            episodes = [PlayedEpisode(request, request.session) for request in requests]
        stats = RolloutStats()
        policy_version = self.engine.policy_version
        if self.config.scheduling == "async":
            await self._play_async(episodes, seed, stats)
        else:
            await self._play_lockstep(episodes, seed, stats)
        stats.env_retries += sum(ep.retries for ep in episodes)
        return [self._trajectory(ep, policy_version) for ep in episodes], stats

    async def _play_async(
        self, episodes: list[PlayedEpisode], seed: int, stats: RolloutStats
    ) -> None:
        """Every episode at its own pace; the time not spent generating counts as env time."""
        started = time.monotonic()
        steps = EpisodeSteps(
            start=self._start,
            generate=lambda batch, call_seed: self._generate(batch, call_seed, stats),
            interact=self._interact,
            generating=lambda ep: ep.state is EpisodeState.GENERATING,
            close=self._close,
        )
        scheduler = EpisodeScheduler(steps, seed=seed, batch_wait_s=self.config.batch_wait_s)
        await scheduler.play(episodes)
        stats.env_seconds += time.monotonic() - started - stats.generate_seconds

    async def _play_lockstep(
        self, episodes: list[PlayedEpisode], seed: int, stats: RolloutStats
    ) -> None:
        started = time.monotonic()
        await asyncio.gather(*(self._start(ep) for ep in episodes))
        stats.env_seconds += time.monotonic() - started

        round_index = 0
        while active := [ep for ep in episodes if ep.state is EpisodeState.GENERATING]:
            await self._generate(active, derive_seed(seed, "round", round_index), stats)
            started = time.monotonic()
            await asyncio.gather(*(self._interact(ep) for ep in active))
            stats.env_seconds += time.monotonic() - started
            round_index += 1

        started = time.monotonic()
        await asyncio.gather(*(self._close(ep) for ep in episodes))
        stats.env_seconds += time.monotonic() - started

    async def _start(self, ep: PlayedEpisode) -> None:
        """Reset the episode, unless it was reset ahead."""
        if ep.state is EpisodeState.PENDING:
            await self._reset(ep)

    async def _reset(self, ep: PlayedEpisode, *, ahead: bool = False) -> None:
        try:
            reset = await ep.session.reset(ep.request.seed, self.config.env_options)
        except (OpenTinkerError, TimeoutError) as err:
            if ahead and isinstance(err, OpenTinkerError) and err.code == "RESOURCE_EXHAUSTED":
                return  # every instance is full: PENDING, reset when played (reset_ahead)
            await self._fail(ep, f"reset failed: {err}", err)
            return
        if problem := reset_problem(reset, self.config.max_observation_chars):
            ep.finish(FinishReason.ENV_ERROR, f"bad reset reply: {problem}")
            return
        # The episode's own system prompt wins; the spec's stands in when Reset sends none.
        system_prompt = reset.system_prompt or self.env.system_prompt
        if system_prompt:
            ep.messages.append(ChatMessage("system", system_prompt))
        ep.messages.append(ChatMessage("user", reset.observation))
        try:
            prompt = prompt_ids_with_images(self.chat, self.vision, system_prompt, reset)
        except ValueError as err:
            ep.finish(FinishReason.ENV_ERROR, f"bad reset reply: {err}")
            return
        ep.images.extend(reset.images)
        ep.token_ids = list(prompt)
        ep.prompt_length = len(prompt)
        if len(prompt) >= self.config.max_episode_tokens:
            ep.finish(
                FinishReason.MAX_TOKENS,
                f"the prompt has {len(prompt)} tokens, max_episode_tokens is "
                f"{self.config.max_episode_tokens}",
            )
            return
        ep.state = EpisodeState.GENERATING

    async def _generate(self, active: list[PlayedEpisode], seed: int, stats: RolloutStats) -> None:
        """One batched engine call for every GENERATING episode; appends each model turn."""
        limits, sampling = turn_budgets(self.config, [len(ep.token_ids) for ep in active])
        started = time.monotonic()
        prompts = [ep.token_ids for ep in active]
        if self.config.greedy:  # only then: engines without greedy decoding still serve training
            call = functools.partial(self.engine.generate, prompts, sampling, seed, greedy=True)
        else:
            call = functools.partial(self.engine.generate, prompts, sampling, seed)
        if any(ep.images for ep in active):  # only then: text engines need not take images
            call = functools.partial(call, images=[ep.images for ep in active])
        completions: list[Completion] = await asyncio.to_thread(call)
        stats.generate_seconds += time.monotonic() - started
        for ep, completion, limit in zip(active, completions, limits, strict=True):
            ids, logprobs = completion.token_ids[:limit], completion.logprobs[:limit]
            ep.turn_start = len(ep.token_ids)
            ep.append(ids, logprobs, mask=1)
            ep.num_turns += 1
            ep.state = EpisodeState.INTERACTING
            stats.generated_tokens += len(ids)

    async def _interact(self, ep: PlayedEpisode) -> None:
        turn = ep.token_ids[ep.turn_start :]
        action = self._decode(turn, skip_special_tokens=True)
        ep.messages.append(ChatMessage("assistant", action))
        try:
            outcome = await self._step(ep, action)
        except (OpenTinkerError, TimeoutError) as err:
            await self._fail(ep, f"step {ep.num_turns} failed: {err}", err, stepping=True)
            return
        if problem := step_problem(outcome, self.config.max_observation_chars):
            ep.finish(FinishReason.ENV_ERROR, f"bad reply to step {ep.num_turns}: {problem}")
            return
        ep.info = dict(outcome.info)
        ep.reward += outcome.reward
        ep.turn_rewards.append(outcome.reward)
        ep.turn_ends.append(len(ep.token_ids) - ep.prompt_length)
        if outcome.done:
            ep.finish(FinishReason.ENV_DONE)
            return
        if ep.num_turns >= self.max_turns:
            ep.finish(FinishReason.MAX_TURNS, f"{ep.num_turns} turns")
            return
        # Close the assistant turn with exactly one eos (the model's own, when it stopped).
        closing = [] if turn and turn[-1] == self.chat.eos_token_id else [self.chat.eos_token_id]
        try:
            turn_ids = observation_ids_with_images(self.chat, self.vision, outcome)
        except ValueError as err:
            ep.finish(FinishReason.ENV_ERROR, f"bad reply to step {ep.num_turns}: {err}")
            return
        observation = [*closing, *turn_ids]
        if len(ep.token_ids) + len(observation) >= self.config.max_episode_tokens:
            ep.finish(
                FinishReason.MAX_TOKENS,
                f"{len(ep.token_ids)} tokens; the next observation would pass "
                f"max_episode_tokens={self.config.max_episode_tokens}",
            )
            return
        ep.append(observation, [0.0] * len(observation), mask=0)
        ep.messages.append(ChatMessage("user", outcome.observation))
        ep.images.extend(outcome.images)
        ep.state = EpisodeState.GENERATING

    async def _step(self, ep: PlayedEpisode, action: str) -> StepOutcome:
        """Step the env with the turn's raw text; an env with tools also gets the parsed calls."""
        if not self.env.tools:
            return await ep.session.step(action)
        calls = parse_tool_calls(action, self._tool_names, self.chat.tool_call_style)
        return await ep.session.step(action, calls)

    async def _fail(
        self,
        ep: PlayedEpisode,
        what: str,
        err: OpenTinkerError | TimeoutError,
        *,
        stepping: bool = False,
    ) -> None:
        """End the episode with ENV_ERROR, or start it over when its env instance (or the
        link to the envs) died, or (``stepping``) the env lost it."""
        reopen = ep.request.reopen
        kind, why = restart_after(err, ep, self.config, stepping=stepping)
        if not kind or reopen is None:
            ep.finish(FinishReason.ENV_ERROR, f"{what}{why}")
            return
        await self._start_over(ep, reopen, err, env_failure=kind == "env")

    async def _start_over(
        self,
        ep: PlayedEpisode,
        reopen: Callable[[str], EnvSession],
        err: OpenTinkerError | TimeoutError,
        *,
        env_failure: bool,
    ) -> None:
        """Play the episode again from Reset (same seed) on a fresh session and env episode id."""
        await self._close(ep)  # best effort: the instance (or the link) is most likely gone
        env_episode_id = f"{ep.request.episode_id}-r{ep.restarts + 1}"
        log.warning(
            "episode_restarting",
            episode_id=ep.request.episode_id,
            env_episode_id=env_episode_id,
            env_failure=env_failure,
            error=str(err),
        )
        ep.start_over(reopen(env_episode_id), env_failure=env_failure)
        await self._reset(ep)

    async def _close(self, ep: PlayedEpisode) -> None:
        await close_session(ep.session, ep.request.episode_id)

    def _decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
        return decode(self.engine.tokenizer, ids, skip_special_tokens=skip_special_tokens)

    def _trajectory(self, ep: PlayedEpisode, policy_version: int) -> Trajectory:
        assert ep.finish_reason is not None, "every episode ends with a reason"
        completion = ep.token_ids[ep.prompt_length :]
        return Trajectory(
            episode_id=ep.request.episode_id,
            group_index=ep.request.group_index,
            token_ids=ep.token_ids,
            prompt_length=ep.prompt_length,
            logprobs=ep.logprobs,
            loss_mask=ep.loss_mask,
            reward=ep.reward,
            num_turns=ep.num_turns,
            finish_reason=ep.finish_reason,
            finish_detail=ep.finish_detail,
            completion_text=self._decode(completion, skip_special_tokens=False),
            policy_version=policy_version,
            info=ep.info,
            env_retries=ep.retries,
            messages=ep.messages,
            turn_rewards=ep.turn_rewards,
            turn_ends=ep.turn_ends,
            images=ep.images,
        )
