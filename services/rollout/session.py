"""One trainer's rollout session: load the engine, apply weight updates (engine_updates.py),
collect batches.

Plain asyncio; knows nothing of the gRPC stream that drives it (see ``service.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from opentinker.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
)
from opentinker.services.rollout.agent.agent_loop import AgentLoop
from opentinker.services.rollout.agent.batch_ahead import BatchAhead, BatchKey, batch_requests
from opentinker.services.rollout.agent.env_replies import env_spec_from_proto
from opentinker.services.rollout.agent.loop_config import EpisodeRequest, LoopConfig
from opentinker.services.rollout.agent.seeds import derive_seed, eval_episode_seed
from opentinker.services.rollout.config import RolloutConfig
from opentinker.services.rollout.engines.engine import GenerationEngine, TransformersEngine
from opentinker.services.rollout.engines.engine_updates import EngineUpdates
from opentinker.services.rollout.engines.token_sampling import (
    SampledTokens,
    check_context_length,
    check_token_ids,
    sample_tokens,
)
from opentinker.services.rollout.engines.top_logprobs import check_top_k, engine_top_logprobs
from opentinker.services.rollout.envs.envhub_client import EnvHubClient
from opentinker.services.rollout.envs.envhub_link import EnvHubLink
from opentinker.services.rollout.inference import ADAPTER_CONFIG, load_inference_engine
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.rollout.types import EnvSpec, FinishReason, Trajectory, TrajectoryBatch
from opentinker.spec import ModelSpec, SamplingParams

log = structlog.get_logger("opentinker.rollout.session")

EngineFactory = Callable[[ModelSpec], GenerationEngine]


def one_row_per_episode(trajectories: list[Trajectory]) -> list[Trajectory]:
    """An agent episode whose conversation was rewritten arrives as one row per segment (each
    with the episode's finish): it counts once, by its first segment, so its rows do not dilute
    a batch's failed share."""
    return [t for t in trajectories if t.info.get("agent_segment", "0") == "0"]


class EnvBatchFailedError(UnavailableError):
    """Too many episodes of a batch ended with ENV_ERROR to train on it."""


class RolloutSession:
    """Serves one job: its engine, its environment, its batches."""

    def __init__(self, settings: RolloutSettings, engine_factory: EngineFactory) -> None:
        self.settings = settings
        self._engine_factory = engine_factory
        self.config: RolloutConfig | None = None
        self.engine: GenerationEngine | None = None
        self._loop: AgentLoop | None = None
        self._updates: EngineUpdates | None = None  # the engine's weight updates, once open
        self.roles: tuple[str, ...] = ()  # the env's roles (multi-agent), once open
        self._link: EnvHubLink | None = None  # the job's episode stream, kept across batches
        self._ahead: BatchAhead | None = None  # the next batch's episodes, reset early

    async def open(self, config: RolloutConfig) -> GenerationEngine:
        """Check the environment is reachable, then load the model (policy version 0)."""
        if self.config is not None:
            raise FailedPreconditionError("the rollout is already open; send OpenRollout once")
        _refuse_agent_programs_unless_enabled(config, self.settings)
        env = EnvSpec()
        if not config.sampling_only:
            if not self.settings.envhub_address:
                raise FailedPreconditionError(
                    "the rollout has no EnvHub address (set envhub_address)"
                )
            # Fails early on an unknown/unreachable env; its spec (turn limit, tools) is read
            # here, once per job.
            async with self._envhub_client(config) as client:
                assert client.spec is not None, "an opened client has its env's spec"
                env = env_spec_from_proto(client.spec)
        try:
            engine = await asyncio.to_thread(self._load_engine, config)
        except (OSError, ValueError) as err:
            raise InvalidArgumentError(
                f"cannot load model {config.model.base_model!r}: {err}", code="INVALID_ARGUMENT"
            ) from err
        role_adapters = bool(env.roles) and config.role_adapters
        if role_adapters:
            await asyncio.to_thread(_serve_role_adapters, engine, env.role_names)
        self.config, self.engine = config, engine
        self._updates = EngineUpdates(engine)
        self.roles = env.role_names
        self._loop = AgentLoop(
            engine,
            LoopConfig(
                sampling=config.sampling,
                max_turns=config.max_turns,
                max_episode_tokens=config.max_episode_tokens,
                env_options=config.env_options,
                max_episode_retries=self.settings.max_episode_retries,
                max_observation_chars=self.settings.max_observation_chars,
                scheduling=self.settings.agent_loop,
                batch_wait_s=self.settings.batch_wait_s,
                role_adapters=role_adapters,
                agent=config.agent,
            ),
            env,
        )
        if self.settings.reset_ahead and self._loop.multi_agent is None:
            self._ahead = BatchAhead(self._loop, probe_s=self.settings.reset_ahead_probe_s)
        keep_prefixes = getattr(engine, "keep_prefixes", None)  # transformers, private or shared
        if keep_prefixes is not None:  # multi-turn: a turn continues the last
            multi_turn = self._loop.max_turns > 1
            capacity = self.settings.prefix_cache_mb * 2**20 if multi_turn else 0
            # A shared engine takes its lock, which a generation in progress holds.
            await asyncio.to_thread(keep_prefixes, capacity)
        log.info(
            "rollout_opened",
            job_id=config.job_id,
            model=config.model.base_model,
            env=config.env_name,
        )
        return engine

    def weight_updates(self, what: str) -> EngineUpdates:
        """The open engine's weight updates (engine_updates.py); ``what`` names the message
        that needs them, for the error when it arrives before OpenRollout."""
        self.require_open(what)
        assert self._updates is not None, "an open session has its engine's updates"
        return self._updates

    async def collect(self, batch_index: int, num_groups: int, group_size: int) -> TrajectoryBatch:
        """Play num_groups * group_size episodes; the episodes of a group share a reset seed."""
        engine = self.require_open("CollectTrajectories")
        assert self.config is not None and self._loop is not None
        if self.config.sampling_only:
            raise FailedPreconditionError(
                "this rollout was opened sampling_only (a training session): it plays no "
                "episodes; use SampleTokens",
                code="FAILED_PRECONDITION",
            )
        if num_groups < 1 or group_size < 1:
            raise InvalidArgumentError(
                f"CollectTrajectories needs num_groups >= 1 and group_size >= 1, "
                f"got {num_groups} and {group_size}",
                code="INVALID_ARGUMENT",
            )
        config = self.config
        envhub = await self._episode_link(config)
        reconnects = envhub.reconnects  # the link lives on: count this batch's own
        key = BatchKey(batch_index, num_groups, group_size)
        ready = await self._ahead.take(key, envhub) if self._ahead is not None else None
        trajectories, stats = await self._loop.run(
            ready or batch_requests(config, envhub, key),
            seed=derive_seed(config.seed, "sample", batch_index),
            every_segment=True,  # a rewritten agent conversation trains all its segments
        )
        if envhub.gone is not None:  # EnvHub stayed away: say so, not "N episodes failed"
            raise envhub.gone
        episodes = one_row_per_episode(trajectories)
        failed = [t for t in episodes if t.finish_reason is FinishReason.ENV_ERROR]
        if len(failed) > self.settings.max_env_error_fraction * len(episodes):
            raise EnvBatchFailedError(
                f"{len(failed)} of {len(episodes)} episodes of environment "
                f"'{config.env_name}' failed in batch {batch_index}; "
                f"first: {failed[0].finish_detail}",
                code="UNAVAILABLE",
            )
        log.info(
            "batch_collected",
            batch_index=batch_index,
            episodes=len(trajectories),
            env_errors=len(failed),
            env_retries=stats.env_retries,
            envhub_reconnects=envhub.reconnects - reconnects,
            policy_version=engine.policy_version,
            generate_s=round(stats.generate_seconds, 3),
            env_s=round(stats.env_seconds, 3),
            tokens=stats.generated_tokens,
            reset_ahead=ready is not None,
        )
        if self._ahead is not None:  # the next batch's resets, while the trainer trains
            self._ahead.start(key.next(), envhub, batch_requests(config, envhub, key.next()))
        return TrajectoryBatch(batch_index=batch_index, trajectories=trajectories, stats=stats)

    async def evaluate(
        self,
        batch_index: int,
        episodes: int,
        *,
        first_episode: int,
        temperature: float,
        samples: int = 1,
    ) -> TrajectoryBatch:
        """Play ``episodes`` evaluation episodes, each ``samples`` times (sharing its env seed
        and group_index: pass@k): seeds from the evaluation stream (episode
        ``first_episode + i``), env options merged with eval_env_options, temperature 0 =
        greedy. Env errors stay in the batch (never raised as a failed batch)."""
        engine = self.require_open("CollectTrajectories")
        assert self.config is not None and self._loop is not None
        if episodes < 1 or first_episode < 0:
            raise InvalidArgumentError(
                f"an evaluation CollectTrajectories needs num_groups >= 1 and first_episode >= 0, "
                f"got {episodes} and {first_episode}",
                code="INVALID_ARGUMENT",
            )
        config = self.config
        sampling = config.sampling
        if temperature > 0:
            sampling = sampling.model_copy(update={"temperature": temperature})
        loop = AgentLoop(
            engine,
            dataclasses.replace(
                self._loop.config,
                sampling=sampling,
                greedy=temperature == 0,
                env_options={**config.env_options, **config.eval_env_options},
            ),
            self._loop.env,
        )
        envhub = await self._episode_link(config)
        requests = []
        for i in range(first_episode, first_episode + episodes):
            seed = eval_episode_seed(config.seed, i)
            for sample in range(samples):
                eid = f"{config.job_id}-v{batch_index}-e{i}" + (f"-s{sample}" if sample else "")
                requests.append(EpisodeRequest(eid, i, seed, envhub.session(eid), envhub.session))
        # The next training batch, reset ahead, may hold every slot of the env: freed meanwhile.
        ahead = await self._ahead.set_aside() if self._ahead is not None else None
        trajectories, stats = await loop.run(
            requests, seed=derive_seed(config.seed, "sample", first_episode)
        )
        if envhub.gone is not None:
            raise envhub.gone
        if self._ahead is not None and ahead is not None:
            self._ahead.start(ahead, envhub, batch_requests(config, envhub, ahead))
        log.info(
            "evaluation_collected",
            batch_index=batch_index,
            first_episode=first_episode,
            episodes=len(trajectories),
            env_errors=sum(t.finish_reason is FinishReason.ENV_ERROR for t in trajectories),
            policy_version=engine.policy_version,
        )
        return TrajectoryBatch(batch_index=batch_index, trajectories=trajectories, stats=stats)

    def _load_engine(self, config: RolloutConfig) -> GenerationEngine:
        """The job's engine; a trained adapter (inference) is merged into its base model."""
        model = config.model.base_model
        if config.adapter_dir or (Path(model) / ADAPTER_CONFIG).is_file():
            return load_inference_engine(
                model,
                adapter_dir=config.adapter_dir or None,
                device=self.settings.device or None,
                max_batch_size=self.settings.max_batch_size,
            )
        return self._engine_factory(config.model)

    async def sample(
        self,
        prompt: Sequence[int],
        *,
        num_samples: int,
        sampling: SamplingParams,
        stop_token_ids: Sequence[int],
        seed: int,
        greedy: bool = False,
    ) -> tuple[list[SampledTokens], int]:
        """Completions of ``prompt`` and the policy version that generated them."""
        engine = self.require_open("SampleTokens")
        samples = await asyncio.to_thread(
            sample_tokens,
            engine,
            prompt,
            num_samples=num_samples,
            sampling=sampling,
            stop_token_ids=stop_token_ids,
            seed=seed,
            greedy=greedy,
        )
        return samples, engine.policy_version

    async def score(self, token_ids: Sequence[int]) -> tuple[list[float], int]:
        """logprob(ids[i+1] | ids[:i+1]) under the engine's weights, and their version."""
        engine = self.require_open("ScoreTokens")
        if len(token_ids) < 2:
            raise InvalidArgumentError("token_ids: at least 2 ids to score (the first has none)")
        check_context_length(
            engine,
            len(token_ids),
            f"{len(token_ids)} token_ids",
            "send at most that many (shorten or split the sequence)",
        )
        check_token_ids(engine, token_ids, "token_ids")
        logprobs = await asyncio.to_thread(engine.logprobs_of, list(token_ids))
        return logprobs, engine.policy_version

    async def top_logprobs(self, token_ids: Sequence[int], k: int) -> tuple[list[int], list[float]]:
        """The k likeliest next tokens at each position of ``token_ids`` (checked by
        ``score`` first), flat row-major (top_logprobs.py)."""
        check_top_k(k)
        return await asyncio.to_thread(
            engine_top_logprobs, self.require_open("ScoreTokens"), list(token_ids), k
        )

    async def _episode_link(self, config: RolloutConfig) -> EnvHubLink:
        """The job's link to EnvHub, opened at the first batch and kept for the next ones (a
        stream per batch cost a connection, its authentication and two round trips every
        step); one that gave up (EnvHub away past the bound) is replaced by a fresh one."""
        if self._link is not None and self._link.gone is not None:
            await self._link.close()
            self._link = None
        if self._link is None:
            link = self._envhub(config)
            try:
                await link.open()
            except BaseException:
                await link.close()
                raise
            self._link = link
        return self._link

    async def close(self) -> None:
        """End the job's episode stream (EnvHub closes what is still open on it)."""
        if self._ahead is not None:
            await self._ahead.close()
        if self._link is not None:
            link, self._link = self._link, None
            await link.close()

    def _envhub(self, config: RolloutConfig) -> EnvHubLink:
        """A link to EnvHub for the job's env that rides out EnvHub restarts (see envhub_link)."""
        return EnvHubLink(
            lambda: self._envhub_client(config),
            address=self.settings.envhub_address,
            env_name=config.env_name,
            reconnect_s=self.settings.envhub_reconnect_s,
        )

    def _envhub_client(self, config: RolloutConfig) -> EnvHubClient:
        return EnvHubClient(
            self.settings.envhub_address,
            job_id=config.job_id,
            env_name=config.env_name,
            timeout_s=self.settings.env_timeout_s,
            heartbeat_interval_s=self.settings.env_heartbeat_s,
            credential=self.settings.credential,
        )

    def require_open(self, what: str) -> GenerationEngine:
        if self.engine is None:
            raise FailedPreconditionError(
                f"{what} arrived before OpenRollout; open the rollout first",
                code="FAILED_PRECONDITION",
            )
        return self.engine


def _serve_role_adapters(engine: GenerationEngine, roles: tuple[str, ...]) -> None:
    """One LoRA adapter per role on the engine (the job trains them so)."""
    if not isinstance(engine, TransformersEngine):
        raise InvalidArgumentError(
            f"the {engine.name} engine cannot serve one LoRA adapter per role; set the job's "
            "rl.role_adapters to 'shared'",
            code="INVALID_ARGUMENT",
        )
    try:
        engine.use_role_adapters(roles)
    except ValueError as err:
        raise InvalidArgumentError(f"one adapter per role: {err}", code="INVALID_ARGUMENT") from err


def _refuse_agent_programs_unless_enabled(config: RolloutConfig, settings: RolloutSettings) -> None:
    """An agent program is the tenant's code run on the worker: only where the operator lets it."""
    if config.agent and not settings.agent_programs:
        raise FailedPreconditionError(
            "rl.agent: this pool does not run agent programs: they run the tenant's code on "
            "the worker, so its operator enables them on the workers with "
            "OPENTINKER_ROLLOUT_AGENT_PROGRAMS=true"
        )
