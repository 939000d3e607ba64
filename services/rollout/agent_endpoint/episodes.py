"""Episodes played by an agent program through the endpoint, in place of the agent loop.

Each episode: Reset the env (the observation is the task) -> serve the episode's endpoint ->
run the program with its base URL and key -> the reward is the program's, or else the env
grades the last reply (one Step with its text) -> its trajectory: the last token segment
(segments.py), or for training one trajectory per segment (more than one when the agent
rewrote its conversation), each with the episode's reward. A program that fails or runs past
its time, or an env that fails, ends the episode with ENV_ERROR and the reason; the other
episodes go on. An env instance that died (or lost the episode), or a lost link to the envs,
starts the episode over from Reset on a fresh session, program and all, as the agent loop
restarts its episodes (``max_episode_retries``; ``env_retries`` on the trajectory).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from opentinker.errors import OpenTinkerError
from opentinker.services.rollout.agent.chat_format import decode
from opentinker.services.rollout.agent.env_replies import reset_problem, restart_after, step_problem
from opentinker.services.rollout.agent.loop_config import (
    EnvSession,
    EpisodeRequest,
    LoopConfig,
    close_session,
)
from opentinker.services.rollout.agent_endpoint.calls import GenerationQueue
from opentinker.services.rollout.agent_endpoint.openai_wire import (
    ChatRequest,
    completion_body,
    finish_reason,
    reply_message,
)
from opentinker.services.rollout.agent_endpoint.program import (
    AgentProgramError,
    load_callable,
    run_program,
)
from opentinker.services.rollout.agent_endpoint.segments import EpisodeRecord, Segment, text_of
from opentinker.services.rollout.agent_endpoint.server import CallRefusedError, EndpointServer
from opentinker.services.rollout.agent_endpoint.settings import EndpointSettings
from opentinker.services.rollout.engines.engine import GenerationEngine
from opentinker.services.rollout.types import ChatMessage, FinishReason, RolloutStats, Trajectory
from opentinker.spec_agent import AgentProgram

log = structlog.get_logger("opentinker.rollout.agent_endpoint")
MAX_AGENT_THREADS = 1024  # sync callables each hold a thread while they play


@dataclass
class _Episode:
    """One episode's state; ``start_over`` clears what its attempt played (env_replies's
    ``Restartable``: its request, ``retries`` after env failures, every restart)."""

    request: EpisodeRequest
    session: EnvSession
    record: EpisodeRecord
    finish: FinishReason | None = None  # set when a budget ended it
    detail: str = ""
    messages: list[ChatMessage] = field(default_factory=list)
    last_text: str = ""  # the last reply's text (tool calls included), graded by the env
    info: dict[str, str] = field(default_factory=dict)
    grading: bool = False  # the env is grading the answer (a Step): NOT_FOUND = it lost it
    retries: int = 0
    restarts: int = 0
    # Calls of one episode are served one at a time, in arrival order: each extends the record.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def start_over(self, session: EnvSession, *, env_failure: bool) -> None:
        self.session, self.record = session, EpisodeRecord(self.record.tokenizer)
        self.finish, self.detail, self.messages = None, "", []
        self.last_text, self.info, self.grading = "", {}, False
        self.retries += env_failure
        self.restarts += 1


class AgentProgramLoop:
    """Plays batches of episodes with an agent program; the same ``run`` as ``AgentLoop``."""

    def __init__(
        self,
        engine: GenerationEngine,
        config: LoopConfig,
        program: AgentProgram,
        max_turns: int,
        *,
        endpoint: EndpointSettings | None = None,
    ) -> None:
        """endpoint: where the endpoint listens (default: OPENTINKER_AGENT_ENDPOINT_*)."""
        self.engine = engine
        self.config = config
        self.program = program
        self.max_turns = max_turns
        self.function = load_callable(program)  # fails at open, naming agent.callable
        self.server = EndpointServer(endpoint)
        self._threads = concurrent.futures.ThreadPoolExecutor(MAX_AGENT_THREADS, "agent")
        self.model_name = getattr(engine, "model_name", "") or "opentinker-policy"

    async def close(self) -> None:
        """Stop a server still serving (a run cut short) and the programs' threads."""
        await self.server.stop()
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def run(
        self, requests: Sequence[EpisodeRequest], *, seed: int, every_segment: bool = False
    ) -> tuple[list[Trajectory], RolloutStats]:
        """A trajectory per episode (its last segment: the conversation that led to the
        answer, as evaluation and inference report it), or with ``every_segment`` (training)
        one per token segment of an episode the agent rewrote, so every model turn trains."""
        await self.server.start()
        stats = RolloutStats()
        playing = [len(requests)]
        queue = GenerationQueue(
            self.engine, self.config, seed=seed, stats=stats, waiting_for=lambda: playing[0]
        )
        policy_version = self.engine.policy_version

        async def play(request: EpisodeRequest) -> list[Trajectory]:
            try:
                return await self._play(request, queue, policy_version)
            finally:
                playing[0] -= 1
                queue.episode_ended()

        try:
            played = await asyncio.gather(*(play(r) for r in requests))
        finally:
            await queue.close()
            await self.server.stop()  # served per run: an evaluation's loop leaves nothing
        stats.env_retries += sum(segments[-1].env_retries for segments in played)
        if not every_segment:
            return [segments[-1] for segments in played], stats
        return [t for segments in played for t in segments], stats

    async def _play(
        self, request: EpisodeRequest, queue: GenerationQueue, policy_version: int
    ) -> list[Trajectory]:
        ep = _Episode(request, request.session, EpisodeRecord(self.engine.tokenizer))
        reward = await self._attempt(ep, queue)
        while reward is None:  # the env instance or the link died: the episode starts over
            reward = await self._attempt(ep, queue)
        if ep.finish is None and not ep.record.segments:
            ep.finish, ep.detail = FinishReason.ENV_ERROR, "the agent program made no model call"
        if ep.record.rewrites:
            log.warning(
                "agent_conversation_rewritten",
                episode_id=request.episode_id,
                rewrites=ep.record.rewrites,
                segments=len(ep.record.segments),
            )
        return self._trajectories(ep, reward, policy_version)

    async def _attempt(self, ep: _Episode, queue: GenerationQueue) -> float | None:
        """Play the episode once: its reward (0 when it failed), or None when its env
        instance died or lost it, or the link to the envs broke, and it starts over from
        Reset on a fresh session, as the agent loop restarts one (env_replies.restart_after:
        max_episode_retries, max_link_restarts). The program's own failures are final."""
        err: OpenTinkerError | TimeoutError | AgentProgramError
        try:
            return await self._episode(ep, queue)
        except (OpenTinkerError, TimeoutError, AgentProgramError) as caught:
            err = caught
        finally:
            self.server.close(ep.request.episode_id)
            await close_session(ep.session, ep.request.episode_id)
        kind, why = "", ""
        if not isinstance(err, AgentProgramError):
            kind, why = restart_after(err, ep, self.config, stepping=ep.grading)
        reopen = ep.request.reopen
        if kind and reopen is not None:
            env_episode_id = f"{ep.request.episode_id}-r{ep.restarts + 1}"
            log.warning(
                "agent_episode_restarting",
                episode_id=ep.request.episode_id,
                env_episode_id=env_episode_id,
                env_failure=kind == "env",
                error=str(err),
            )
            ep.start_over(reopen(env_episode_id), env_failure=kind == "env")
            return None
        if ep.finish is None:  # else a budget ended it, and the program failed on that
            ep.finish, ep.detail = FinishReason.ENV_ERROR, f"{err}{why}"
        return 0.0

    async def _episode(self, ep: _Episode, queue: GenerationQueue) -> float:
        """Reset, run the program, grade; the reward."""
        session, request = ep.session, ep.request
        reset = await session.reset(request.seed, self.config.env_options)
        if problem := reset_problem(reset, self.config.max_observation_chars):
            raise AgentProgramError(f"bad reset reply: {problem}")
        ep.messages.append(ChatMessage("user", reset.observation))

        async def complete(call: ChatRequest) -> dict[str, Any]:
            async with ep.lock:
                return await self._complete(ep, call, queue)

        base_url, api_key = self.server.open(request.episode_id, self.model_name, complete)
        reward = await run_program(
            self.program,
            self.function,
            self._threads,
            base_url=base_url,
            api_key=api_key,
            task=reset.observation,
            seed=request.seed,
        )
        if reward is not None:
            ep.finish = ep.finish or FinishReason.ENV_DONE
            return reward
        ep.grading = True
        outcome = await session.step(ep.last_text)  # the env grades the last answer
        if problem := step_problem(outcome, self.config.max_observation_chars):
            raise AgentProgramError(f"bad reply to the grading step: {problem}")
        ep.info = dict(outcome.info)
        ep.finish = ep.finish or FinishReason.ENV_DONE
        return outcome.reward

    async def _complete(
        self, ep: _Episode, call: ChatRequest, queue: GenerationQueue
    ) -> dict[str, Any]:
        """One chat completion of the episode: generate, record, answer."""
        if ep.record.calls >= self.max_turns:
            ep.finish, ep.detail = FinishReason.MAX_TURNS, f"{ep.record.calls} turns"
            raise CallRefusedError(
                f"this episode's turn budget is spent ({self.max_turns} model calls, the "
                "job's max_turns): answer now",
                "max_turns_reached",
            )
        prompt = ep.record.prompt(call.messages, call.tools)
        room = self.config.max_episode_tokens - len(prompt)
        limit = min(self.config.sampling.max_new_tokens, room, call.token_cap or room)
        if limit < 1:
            ep.finish = FinishReason.MAX_TOKENS
            ep.detail = f"{len(prompt)} tokens; max_episode_tokens={self.config.max_episode_tokens}"
            raise CallRefusedError(
                f"the conversation has {len(prompt)} tokens and the episode's budget is "
                f"max_episode_tokens={self.config.max_episode_tokens}: no room to reply",
                "context_length_exceeded",
            )
        completion = await queue.generate(prompt, limit)
        ids = completion.token_ids
        stopped = bool(ids) and ids[-1] == ep.record.eos
        text = decode(self.engine.tokenizer, ids, skip_special_tokens=True)
        message = reply_message(text, call.tool_names)
        ep.record.add_reply(ids, completion.logprobs, message)
        ep.last_text = text
        ep.messages.extend(
            ChatMessage(m.get("role", "user"), text_of(m.get("content")))
            for m in call.messages[len(ep.messages) :]
        )
        ep.messages.append(ChatMessage("assistant", text))
        body = completion_body(
            self.model_name, message, finish_reason(message, stopped), len(prompt), len(ids)
        )
        return body

    def _trajectories(self, ep: _Episode, reward: float, policy_version: int) -> list[Trajectory]:
        """One trajectory per token segment, in order, each with the episode's reward on its
        last turn: every model turn trains once, in the segment that sampled it (a later
        segment renders the earlier turns as its prompt, loss mask 0). All share the
        episode's id and group; the trainer counts them as one episode (one return in the
        group's baseline)."""
        record = ep.record
        info = ep.info | {
            "agent_calls": str(record.calls),
            "agent_segments": str(len(record.segments)),
            "agent_rewrites": str(record.rewrites),
        }
        if not record.segments or not math.isfinite(reward):
            return [
                Trajectory(
                    episode_id=ep.request.episode_id,
                    group_index=ep.request.group_index,
                    token_ids=[],
                    prompt_length=0,
                    logprobs=[],
                    loss_mask=[],
                    reward=0.0,
                    num_turns=0,
                    finish_reason=FinishReason.ENV_ERROR,
                    finish_detail=ep.detail or "the agent program made no model call",
                    policy_version=policy_version,
                    info=info,
                    env_retries=ep.retries,
                    messages=ep.messages,
                )
            ]
        last = len(record.segments) - 1
        return [
            self._segment_trajectory(
                ep,
                segment,
                reward,
                policy_version,
                info | {"agent_segment": str(index)},
                last=index == last,
            )
            for index, segment in enumerate(record.segments)
        ]

    def _segment_trajectory(
        self,
        ep: _Episode,
        segment: Segment,
        reward: float,
        policy_version: int,
        info: dict[str, str],
        *,
        last: bool,
    ) -> Trajectory:
        completion = segment.token_ids[segment.prompt_length :]
        ends = segment.turn_ends or [len(completion)]
        return Trajectory(
            episode_id=ep.request.episode_id,
            group_index=ep.request.group_index,
            token_ids=segment.token_ids,
            prompt_length=segment.prompt_length,
            logprobs=segment.logprobs,
            loss_mask=segment.loss_mask,
            reward=reward,
            num_turns=len(segment.turn_ends),
            finish_reason=ep.finish or FinishReason.ENV_ERROR,
            finish_detail=ep.detail,
            completion_text=decode(self.engine.tokenizer, completion, skip_special_tokens=False),
            policy_version=policy_version,
            info=info,
            env_retries=ep.retries,
            messages=ep.messages if last else [],
            turn_rewards=[0.0] * (len(ends) - 1) + [reward],
            turn_ends=ends,
        )
