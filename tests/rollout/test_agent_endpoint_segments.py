"""Every token segment of an agent-program episode trains: an agent that rewrites its
conversation after its first call gives two segments; collected for training, both become
rows of the batch (the first one's model tokens with loss mask 1 and their logprobs), the
episode counts once in the batch's size, its GRPO group's baseline and the metrics, and
evaluation/inference still get one row per episode (its last segment)."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch
from agent_loop_helpers import Countdown, GameSession, RecordingEngine, model_turns

from opentinker.services.rollout.agent.agent_loop import AgentLoop
from opentinker.services.rollout.agent.loop_config import EpisodeRequest, LoopConfig
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.types import FinishReason, Trajectory
from opentinker.services.rollout.wire import trajectory_to_proto
from opentinker.services.trainer.rl.advantages import token_advantages
from opentinker.services.trainer.rl.batch import CollectedBatch, collate
from opentinker.services.trainer.rl.env_error_watch import mixed_prompt_groups
from opentinker.services.trainer.rl.pipeline import usable_episodes
from opentinker.services.trainer.rl.step_metrics import agent_metrics, batch_env_errors
from opentinker.services.trainer.rollout_link.rollout_wire import episode_from_proto
from opentinker.spec import RlConfig, SamplingParams
from opentinker.spec_agent import AgentProgram

pytestmark = pytest.mark.integration


def rewriting_agent(*, base_url: str, api_key: str, task: str, seed: int) -> float:
    """Two calls. Episode ep-0 rewrites the model's first answer before the second call (a
    new segment) and scores 1; the other sends it back as given (one segment) and scores 0."""
    rewrites = "/episodes/ep-0/" in base_url
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    messages: list[dict] = [{"role": "user", "content": task}]
    first = client.chat.completions.create(model="policy", messages=messages)
    answer = first.choices[0].message.model_dump(exclude_none=True)
    if rewrites:
        answer = {"role": "assistant", "content": "a tidier answer of my own"}
    messages += [answer, {"role": "user", "content": "once more"}]
    client.chat.completions.create(model="policy", messages=messages)
    return 1.0 if rewrites else 0.0


def _play(engine: RecordingEngine, *, every_segment: bool) -> tuple[list[Trajectory], int]:
    config = LoopConfig(
        sampling=SamplingParams(temperature=1.0, max_new_tokens=6),
        max_turns=4,
        max_episode_tokens=512,
        agent=AgentProgram(callable="test_agent_endpoint_segments:rewriting_agent"),
    )
    sessions = [GameSession(Countdown(turns=1)) for _ in range(2)]
    # One GRPO group: the same group index and seed (the same task).
    requests = [EpisodeRequest(f"ep-{n}", 0, 5, s) for n, s in enumerate(sessions)]

    async def run() -> tuple[list[Trajectory], int]:
        loop = AgentLoop(engine, config)  # type: ignore[arg-type]
        assert loop.agent_programs is not None
        try:
            trajectories, stats = await loop.run(requests, seed=7, every_segment=every_segment)
        finally:
            await loop.agent_programs.close()
        return trajectories, stats.generated_tokens

    return asyncio.run(run())


def test_every_segment_of_a_rewritten_conversation_reaches_the_batch(
    base_engine: TransformersEngine,
) -> None:
    engine = RecordingEngine(base_engine)
    rows, generated = _play(engine, every_segment=True)
    assert [(t.episode_id, t.info["agent_segment"]) for t in rows] == [
        ("ep-0", "0"),
        ("ep-0", "1"),
        ("ep-1", "0"),
    ]
    assert all(t.finish_reason is FinishReason.ENV_DONE for t in rows), rows[0].finish_detail
    first, second, plain = rows
    produced = [c.token_ids for c in engine.completions]
    # The first segment: the prompt, then the model's first answer: all mask 1, its logprobs.
    [turn] = model_turns(first)
    assert turn in produced and first.loss_mask == [1] * len(turn)
    assert all(lp < 0 for lp in first.logprobs) and first.reward == 1.0
    # The second renders the rewritten conversation as its prompt; only its reply trains.
    assert "a tidier answer" in engine.tokenizer.decode(second.token_ids[: second.prompt_length])
    assert second.loss_mask == [1] * len(second.loss_mask) and model_turns(second)[0] in produced
    assert len(model_turns(plain)) == 2
    # Every sampled token is in a row with mask 1 (the last segment alone misses the first).
    assert generated == sum(sum(t.loss_mask) for t in rows)

    # Through the wire into the trainer: one group of two episodes, three rows.
    episodes = [episode_from_proto(trajectory_to_proto(t)) for t in rows]
    batch = CollectedBatch(episodes, 0.0, 0.0, generated)
    rl = RlConfig(env_name="countdown", prompts_per_step=1, samples_per_prompt=2)
    version = rows[0].policy_version
    usable = usable_episodes(batch, rl, step=0, played_by=version, policy_version=version)
    assert len(usable) == 3
    collated = collate(usable, pad_id=0)
    # Row 0's loss mask covers the first segment's model tokens, at their next-token positions.
    start = first.prompt_length - 1
    mask_row0 = collated.loss_mask_B_T[0, start : start + len(turn)]
    assert mask_row0.tolist() == [1.0] * len(turn) and collated.loss_mask_B_T[0].sum() == len(turn)
    assert collated.tokens_B_L[0, first.prompt_length : len(first.token_ids)].tolist() == turn
    # GRPO over the two episodes (rewards 1 and 0: mean 0.5, std 0.5): +1 on both of ep-0's
    # rows, -1 on ep-1's. Counted per row (1, 1, 0) the first would get (1 - 2/3) / 0.471.
    width = collated.loss_mask_B_T.shape[1]
    adv = token_advantages(usable, width, loss="grpo", gamma=1.0)
    for row, expected in ((0, 1.0), (1, 1.0), (2, -1.0)):
        on = collated.loss_mask_B_T[row] > 0
        assert torch.allclose(adv[row][on], torch.full_like(adv[row][on], expected), atol=1e-4)
    assert agent_metrics(usable) == {"agent_rewrites": 1.0}
    assert batch_env_errors(batch).episodes == 2
    assert mixed_prompt_groups(usable) == []  # the second segment's prompt is not a new task


def test_evaluation_gets_one_row_per_episode(base_engine: TransformersEngine) -> None:
    rows, _ = _play(RecordingEngine(base_engine), every_segment=False)
    assert [(t.episode_id, t.info["agent_segment"]) for t in rows] == [("ep-0", "1"), ("ep-1", "0")]


def test_a_rewritten_episode_counts_once_in_the_batchs_failed_share() -> None:
    """The rollout fails a batch past max_env_error_fraction of its episodes: one failed
    episode among two, the good one rewritten into three segment rows, is half the episodes,
    not a quarter of the rows."""
    from opentinker.services.rollout.session import one_row_per_episode
    from opentinker.services.rollout.types import FinishReason, Trajectory

    def row(episode: str, finish: FinishReason, segment: str | None) -> Trajectory:
        info = {} if segment is None else {"agent_segment": segment}
        return Trajectory(episode, 0, [1, 2], 1, [0.0], [1], 0.0, 1, finish, info=info)

    rows = [row("good", FinishReason.ENV_DONE, s) for s in "012"]
    rows.append(row("bad", FinishReason.ENV_ERROR, None))
    episodes = one_row_per_episode(rows)
    assert [t.episode_id for t in episodes] == ["good", "bad"]
    assert sum(t.finish_reason is FinishReason.ENV_ERROR for t in episodes) / len(episodes) == 0.5
