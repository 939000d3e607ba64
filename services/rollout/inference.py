"""Inference against any registered environment: the backend of ``opentinker infer``.

A model (a base model, a full checkpoint, or a trained LoRA adapter) plays ``episodes``
episodes of an environment through EnvHub with the same ``AgentLoop`` (and the same env code)
as training, in chunks of ``concurrency`` episodes. Every finished episode becomes one jsonl
line; the summary is computed from those lines.

    summary = run_inference(model="runs/job-1/checkpoint", env_name="letter",
                            envhub_address="localhost:50052", episodes=64,
                            output=Path("letter.jsonl"))
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog

from opentinker.auth import api_key_from_env
from opentinker.errors import ConfigError
from opentinker.inference_rows import (
    InferenceSummary,
    episode_row,
    options_with_split,
    summarize,
)
from opentinker.services.rollout.agent.agent_loop import AgentLoop
from opentinker.services.rollout.agent.env_replies import env_spec_from_proto
from opentinker.services.rollout.agent.loop_config import EpisodeRequest, LoopConfig
from opentinker.services.rollout.agent.seeds import derive_seed, eval_episode_seed
from opentinker.services.rollout.engines.engine import GenerationEngine, TransformersEngine
from opentinker.services.rollout.envs.envhub_client import EnvHubClient
from opentinker.services.rollout.envs.envhub_link import EnvHubLink
from opentinker.services.rollout.settings import DEFAULT_ENVHUB_RECONNECT_S, DEFAULT_MAX_BATCH_SIZE
from opentinker.services.rollout.types import Trajectory
from opentinker.spec import ModelSpec, SamplingParams

log = structlog.get_logger("opentinker.rollout.inference")

ADAPTER_CONFIG = "adapter_config.json"
ProgressCallback = Callable[[int, int], None]  # (episodes done, episodes in all)


def load_inference_engine(
    model: str,
    *,
    adapter_dir: str | None = None,
    device: str | None = None,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
) -> TransformersEngine:
    """An engine for ``model``: a base model or full checkpoint (anything ``from_pretrained``
    loads), or a PEFT adapter directory (``adapter_config.json``), applied to the base model
    its ``base_model_name_or_path`` names. With ``adapter_dir``: that adapter on ``model``."""
    if adapter_dir:
        spec = ModelSpec(base_model=model, finetune="full")
        return TransformersEngine.load(
            spec, max_batch_size=max_batch_size, device=device, adapter_dir=adapter_dir
        )
    adapter_config = Path(model) / ADAPTER_CONFIG
    if not adapter_config.is_file():
        spec = ModelSpec(base_model=model, finetune="full")
        return TransformersEngine.load(spec, max_batch_size=max_batch_size, device=device)
    base = json.loads(adapter_config.read_text()).get("base_model_name_or_path") or ""
    if not base:
        raise ConfigError(
            f"{adapter_config} names no base_model_name_or_path; cannot tell which base model "
            "the adapter belongs to"
        )
    spec = ModelSpec(base_model=base, finetune="full")
    return TransformersEngine.load(
        spec, max_batch_size=max_batch_size, device=device, adapter_dir=model
    )


def run_inference(
    *,
    model: str,
    env_name: str,
    envhub_address: str,
    episodes: int,
    output: Path,
    api_key: str | None = None,
    env_options: Mapping[str, str] | None = None,
    sampling: SamplingParams | None = None,
    max_turns: int | None = None,
    max_episode_tokens: int = 2048,
    seed: int = 0,
    split: str | None = None,
    concurrency: int = 32,
    greedy: bool = False,
    device: str | None = None,
    env_timeout_s: float = 30.0,
    envhub_reconnect_s: float = DEFAULT_ENVHUB_RECONNECT_S,
    max_episode_retries: int = 2,
    max_observation_chars: int = 16384,
    progress: ProgressCallback | None = None,
) -> InferenceSummary:
    """Play ``episodes`` episodes of ``env_name`` with ``model``; write one jsonl line each.

    model: a base model (id or directory), a full checkpoint directory, or a LoRA adapter
        directory (see ``load_inference_engine``).
    api_key: the key sent to EnvHub (default $OPENTINKER_API_KEY); EnvHub serves the envs of
        the key's tenant and the shared ones.
    split: the dataset split to draw from (passed to the env as the ``split`` option).
    seed: fixes the env seeds of the episodes and the sampling.
    concurrency: episodes played (and generated) together.
    greedy: argmax decoding instead of sampling (``sampling.temperature`` is not used).
    progress: called with (done, total) after every chunk.
    envhub_reconnect_s: how long EnvHub may stay away mid-run (died, restarting) before the run
        fails; meanwhile the episodes it took with it start over from Reset once it is back.

    Raises ConfigError for bad arguments, NotFoundError when EnvHub has no such env,
    UnavailableError when EnvHub cannot be reached at the start (or stays away mid-run past
    envhub_reconnect_s: EnvHubUnreachableError), OSError/ValueError when the model cannot be
    loaded. Episodes that fail in the env are recorded (finish_reason ENV_ERROR), not raised.
    """
    _check_budgets(episodes, concurrency, max_turns, max_episode_tokens)
    config = LoopConfig(
        sampling=sampling or SamplingParams(),
        max_turns=max_turns,
        max_episode_tokens=max_episode_tokens,
        env_options=options_with_split(env_options or {}, split),
        max_episode_retries=max_episode_retries,
        max_observation_chars=max_observation_chars,
        greedy=greedy,
    )
    run = _InferenceRun(
        model=model,
        env_name=env_name,
        envhub_address=envhub_address,
        api_key=api_key_from_env(api_key),
        config=config,
        seed=seed,
        device=device,
        env_timeout_s=env_timeout_s,
        envhub_reconnect_s=envhub_reconnect_s,
        progress=progress,
    )
    return asyncio.run(run.play(episodes, Path(output), concurrency))


def _check_budgets(
    episodes: int, concurrency: int, max_turns: int | None, max_episode_tokens: int
) -> None:
    """ConfigError naming every budget out of range at once."""
    problems = []
    if episodes < 1:
        problems.append(f"episodes must be >= 1, got {episodes}")
    if concurrency < 1:
        problems.append(f"concurrency must be >= 1, got {concurrency}")
    if (max_turns is not None and max_turns < 1) or max_episode_tokens < 8:
        problems.append("max_turns must be >= 1 and max_episode_tokens >= 8")
    if problems:
        raise ConfigError("; ".join(problems))


@dataclass
class _InferenceRun:
    model: str
    env_name: str
    envhub_address: str
    api_key: str
    config: LoopConfig
    seed: int
    device: str | None
    env_timeout_s: float
    envhub_reconnect_s: float
    progress: ProgressCallback | None

    async def play(self, episodes: int, output: Path, concurrency: int) -> InferenceSummary:
        started = time.monotonic()
        run_id = f"infer-{uuid.uuid4().hex[:8]}"
        bound = log.bind(run_id=run_id, env=self.env_name, model=self.model)
        # An unknown env or a dead EnvHub fails here, before the model loads.
        async with self._envhub_client(run_id) as client:
            assert client.spec is not None, "an opened client has its env's spec"
            env = env_spec_from_proto(client.spec)
        engine = await asyncio.to_thread(load_inference_engine, self.model, device=self.device)
        loop = AgentLoop(engine, self.config, env)
        output.parent.mkdir(parents=True, exist_ok=True)
        records: list[dict[str, Any]] = []
        # The episodes' link rides out an EnvHub restart, as a training rollout's does.
        link = EnvHubLink(
            lambda: self._envhub_client(run_id),
            address=self.envhub_address,
            env_name=self.env_name,
            reconnect_s=self.envhub_reconnect_s,
        )
        try:
            await link.open()
            with output.open("w", encoding="utf-8") as out:
                for first in range(0, episodes, concurrency):
                    indices = range(first, min(first + concurrency, episodes))
                    chunk = await self._play_chunk(loop, link, run_id, indices)
                    records.extend(chunk)
                    out.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in chunk)
                    out.flush()
                    self._report(bound, records, episodes)
        finally:
            await link.close()
        summary = summarize(records, output, seconds=time.monotonic() - started)
        bound.info("inference_done", **{k: v for k, v in asdict(summary).items() if k != "output"})
        return summary

    async def _play_chunk(
        self, loop: AgentLoop, link: EnvHubLink, run_id: str, indices: range
    ) -> list[dict[str, Any]]:
        """The rows of episodes ``indices``, played together; raises the link's error when
        EnvHub stayed away (its episodes failed for that, not for the env)."""
        requests = []
        for i in indices:
            eid = f"{run_id}-e{i}"
            env_seed = eval_episode_seed(self.seed, i)
            requests.append(EpisodeRequest(eid, i, env_seed, link.session(eid), link.session))
        trajectories, _ = await loop.run(
            requests, seed=derive_seed(self.seed, "sample", indices.start)
        )
        if link.gone is not None:
            raise link.gone
        seeds = {r.episode_id: r.seed for r in requests}  # self-play: a row per role
        return [_record(t, seeds[t.episode_id], loop.engine) for t in trajectories]

    def _report(
        self,
        bound: structlog.typing.FilteringBoundLogger,
        records: list[dict[str, Any]],
        total: int,
    ) -> None:
        rewards = [r["reward"] for r in records]
        bound.info(
            "inference_progress",
            done=len(records),
            total=total,
            mean_reward=round(sum(rewards) / len(rewards), 4),
        )
        if self.progress is not None:  # games (a self-play game has a row per role)
            self.progress(len({r["episode_id"] for r in records}), total)

    def _envhub_client(self, run_id: str) -> EnvHubClient:
        return EnvHubClient(
            self.envhub_address,
            job_id=run_id,
            env_name=self.env_name,
            timeout_s=self.env_timeout_s,
            heartbeat_interval_s=5.0,
            credential=self.api_key,
        )


def _record(t: Trajectory, env_seed: int, engine: GenerationEngine) -> dict[str, Any]:
    """One jsonl line: the episode's row, with the episode as messages and as the exact
    transcript the model saw."""
    transcript = engine.tokenizer.decode(t.token_ids, skip_special_tokens=False)
    return {
        **trajectory_row(t, index=t.group_index, env_seed=env_seed),
        "messages": [asdict(m) for m in t.messages],
        "transcript": transcript,
    }


def trajectory_row(t: Trajectory, *, index: int, env_seed: int) -> dict[str, Any]:
    """The row fields of a finished episode (see opentinker.inference_rows); a self-play
    game gives a row per role, each with its ``role``."""
    row = episode_row(
        episode_id=t.episode_id,
        index=index,
        env_seed=env_seed,
        reward=t.reward,
        turns=t.num_turns,
        finish_reason=t.finish_reason.value,
        finish_detail=t.finish_detail,
        info=t.info,
        env_retries=t.env_retries,
        completion_tokens=sum(t.loss_mask),
    )
    if t.role:
        row["role"] = t.role
    return row
