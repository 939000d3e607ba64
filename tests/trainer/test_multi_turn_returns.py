"""Per-turn returns end to end: the agent loop keeps each env step's reward and where each
model turn ends, the wire carries them, the trainer turns them into per-token returns (the
hand-derived ones) and trains on them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from agent_loop_helpers import GameSession, RecordingEngine, play

from opentinker.game import AbstractGame, StepResult
from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.wire import trajectory_to_proto
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rl.advantages import token_advantages, turn_rewards_per_token
from opentinker.services.trainer.rl.batch import collate
from opentinker.services.trainer.rl.training import UpdateConfig, rl_update
from opentinker.services.trainer.rollout_link.rollout_wire import episode_from_proto
from opentinker.spec import ModelSpec

pytestmark = pytest.mark.integration

PAYDAYS = (1.0, 0.0, 2.0)  # the reward of steps 1, 2, 3; the episode ends at step 3


class Paydays(AbstractGame):
    """Three turns whatever the model says; step k pays PAYDAYS[k]."""

    name = "paydays"

    def get_system_prompt(self) -> str:
        return "Say anything, three times."

    def reset(self, *, seed: int = 0) -> str:
        self.steps = 0
        return f"Round {seed}."

    def step(self, action: str) -> StepResult:
        self.steps += 1
        done = self.steps == len(PAYDAYS)
        return StepResult(observation="Again.", reward=PAYDAYS[self.steps - 1], done=done)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


def test_multi_turn_episodes_train_on_their_per_turn_returns(model_dir: Path) -> None:
    spec = ModelSpec(base_model=str(model_dir), finetune="full")
    engine = RecordingEngine(TransformersEngine.load(spec, device="cpu"))
    sessions = [GameSession(Paydays()) for _ in range(4)]
    trajectories = play(engine, sessions, max_turns=3, max_new_tokens=3)
    # the wire carries the new fields (rollout service -> trainer client)
    episodes = [episode_from_proto(trajectory_to_proto(t)) for t in trajectories]
    for t, ep in zip(trajectories, episodes, strict=True):
        assert ep.turn_rewards == PAYDAYS and ep.reward == pytest.approx(sum(PAYDAYS))
        assert len(ep.turn_ends) == 3 and list(ep.turn_ends) == sorted(ep.turn_ends)
        for end in ep.turn_ends:  # each turn ends right after a model token, before env tokens
            assert ep.loss_mask[end - 1] == 1
            assert end == ep.completion_length or ep.loss_mask[end] == 0
        assert ep.turn_ends == tuple(t.turn_ends)

    # gamma 0.5: G = [1 + 0.5 * (0 + 0.5 * 2), 0 + 0.5 * 2, 2] = [1.5, 1.0, 2.0]. Every episode
    # has G_0 = 1.5, so the group baseline is 1.5 (GRPO advantage of G_0: 0, scale 1: the
    # rewards do not vary) and a turn-k token gets G_k - 1.5 = [0.0, -0.5, +0.5].
    batch = collate(episodes, pad_id=0)
    width = batch.loss_mask_B_T.shape[1]
    adv_B_T = token_advantages(episodes, width, loss="grpo", gamma=0.5)
    for b, ep in enumerate(episodes):
        start, ends = ep.prompt_length - 1, (0, *ep.turn_ends)
        for k, expected in enumerate((0.0, -0.5, 0.5)):
            span = adv_B_T[b, start + ends[k] : start + ends[k + 1]]
            assert torch.allclose(span, torch.full_like(span, expected)), (b, k, span)
    # PPO puts each turn's reward on the turn's last model token: rewards sum to 3 per episode
    rewards_B_T = turn_rewards_per_token(episodes, batch.loss_mask_B_T)
    assert rewards_B_T.sum(dim=1).tolist() == pytest.approx([3.0] * 4)

    policy = Policy(spec, learning_rate=1e-3)
    before = [p.detach().clone() for p in policy.trainable_parameters()]
    stats = rl_update(policy, episodes, UpdateConfig(loss="grpo", gamma=0.5))
    assert stats.optimizer_steps == 1 and stats.trained_tokens == sum(
        sum(e.loss_mask) for e in episodes
    )
    after = policy.trainable_parameters()
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
