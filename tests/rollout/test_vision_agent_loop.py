"""The agent loop with images: episodes of a vision env played by the tiny Qwen2-VL engine keep
every image with the token ids (reset and step observations), and the trainer-side forward
recomputes their logprobs; a text-only model fails such an episode with a clear reason."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from opentinker.game import StepResult
from opentinker.services.common.tool_calls import ToolCalls
from opentinker.services.envhub.games.geometry_env import GeometryToolsGame
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.modeling.tiny_vl_model import ensure_tiny_vl_model
from opentinker.services.modeling.vision_inputs import ImageInput
from opentinker.services.rollout.agent.agent_loop import AgentLoop
from opentinker.services.rollout.agent.loop_config import EpisodeRequest, LoopConfig
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.types import FinishReason, ResetResult, StepOutcome, Trajectory
from opentinker.services.trainer.model.vision_logprobs import vision_token_logprobs
from opentinker.spec import ModelSpec, SamplingParams

pytestmark = pytest.mark.integration


class FigureAgain(GeometryToolsGame):
    """Every step's observation shows the figure again (an image mid-episode)."""

    def _tool_results(self, action: str) -> str:
        return "Look again."

    def step(self, action: str) -> StepResult:
        result = super().step(action)
        return StepResult(
            result.observation, result.reward, result.done, result.info, self.get_initial_images()
        )


class ImageSession:
    """An in-process EnvSession of a vision game (no gRPC)."""

    def __init__(self, game: GeometryToolsGame) -> None:
        self.game = game

    async def reset(self, seed: int, options: Mapping[str, str]) -> ResetResult:
        question = self.game.reset(seed=seed, **options)
        images = tuple(ImageInput(i.data, i.mime_type) for i in self.game.get_initial_images())
        return ResetResult(self.game.get_system_prompt(), question, images)

    async def step(self, action: str, tool_calls: ToolCalls | None = None) -> StepOutcome:
        r = self.game.step(action)
        images = tuple(ImageInput(i.data, i.mime_type) for i in r.images)
        return StepOutcome(r.observation, r.reward, r.done, r.info, images)

    async def close(self) -> None:
        pass


def play(engine: TransformersEngine, count: int) -> list[Trajectory]:
    config = LoopConfig(
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6),
        max_turns=2,
        max_episode_tokens=1024,
    )
    requests = [EpisodeRequest(f"ep-{n}", n, n, ImageSession(FigureAgain())) for n in range(count)]
    trajectories, _ = asyncio.run(AgentLoop(engine, config).run(requests, seed=3))
    return trajectories


def test_image_episodes_keep_every_image_and_their_logprobs_recompute(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_dir = ensure_tiny_vl_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-vl")
    engine = TransformersEngine.load(
        ModelSpec(base_model=str(model_dir), finetune="full"), device="cpu"
    )
    pad_id = engine.model.config.image_token_id
    for t in play(engine, 3):
        assert t.finish_reason is FinishReason.MAX_TURNS, t.finish_detail
        assert len(t.images) == 2  # the reset's figure, then the step's (the last is unseen)
        assert t.token_ids.count(pad_id) == 2 * 16  # 16 placeholders per 112x112 figure
        assert t.token_ids[: t.prompt_length].count(pad_id) == 16
        recomputed = vision_token_logprobs(
            engine.model, engine.image_processor, t.token_ids, t.images
        )
        on = [k for k, m in enumerate(t.loss_mask) if m]
        rollout = torch.tensor([t.logprobs[k] for k in on])
        trainer = recomputed[[t.prompt_length + k - 1 for k in on]].detach()
        assert torch.allclose(trainer, rollout, atol=1e-4)


def test_a_text_only_model_fails_an_image_episode_naming_why(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_dir: Path = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))
    engine = TransformersEngine.load(
        ModelSpec(base_model=str(model_dir), finetune="full"), device="cpu"
    )
    (t,) = play(engine, 1)
    assert t.finish_reason is FinishReason.ENV_ERROR
    assert "1 images but the model is text-only" in t.finish_detail
