"""One LoRA adapter per role: self-play games on the tiny model, each role's engine call with
its own adapter, a few per-role updates that change BOTH adapters and leave them different,
and a weight sync whose probe checks every role's adapter."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from agent_loop_helpers import RoleSession

from opentinker.game import AbstractGame, Role, StepResult
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.rollout.agent.agent_loop import AgentLoop
from opentinker.services.rollout.agent.loop_config import EpisodeRequest, LoopConfig
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.types import EnvSpec, RoleSpec
from opentinker.services.rollout.wire import trajectory_to_proto
from opentinker.services.trainer import checkpoints
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rl.advantages import episode_advantages
from opentinker.services.trainer.rl.batch import Episode
from opentinker.services.trainer.rl.batch_work import UpdateConfig
from opentinker.services.trainer.rl.role_training import role_update
from opentinker.services.trainer.rollout_link.rollout_wire import episode_from_proto
from opentinker.spec import LoraConfig, ModelSpec, SamplingParams

ROLES = ("black", "white")


class Vowels(AbstractGame):
    """Black and white each speak twice, alternating; each is paid the share of vowels in its
    own text (so samples of a group differ, and each role has its own signal)."""

    name = "vowels"
    roles = (Role("black", "You are black."), Role("white", "You are white."))

    def get_system_prompt(self) -> str:
        return ""

    def reset(self, *, seed: int = 0) -> str:
        self.to_move, self.turns = "black", 0
        return f"Round {seed}."

    def first_role(self) -> str:
        return self.to_move

    def step(self, action: str) -> StepResult:
        role, self.turns = self.to_move, self.turns + 1
        score = sum(c in "aeiouAEIOU" for c in action) / max(len(action), 1)
        self.to_move = "white" if role == "black" else "black"
        return StepResult(
            "Go on.", score, self.turns >= 4, next_role=self.to_move, role_rewards={role: score}
        )


def lora_tensors(policy: Policy, role: str) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in policy.trainable_state().items() if f".{role}." in n}


@pytest.mark.integration
def test_each_role_trains_its_own_adapter_and_the_sync_proves_both(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_dir: Path = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))
    spec = ModelSpec(base_model=str(model_dir), finetune="lora", lora=LoraConfig(rank=4))
    policy = Policy(spec, learning_rate=5e-2, seed=0)
    policy.use_role_adapters(ROLES)
    engine = TransformersEngine.load(spec, device="cpu")
    engine.use_role_adapters(ROLES)
    names = set(policy.trainable_state())
    assert names and all(".black." in n or ".white." in n for n in names)
    assert {n for n in names if ".black." in n} == {
        n.replace(".white.", ".black.") for n in names if ".white." in n
    }
    before = {role: lora_tensors(policy, role) for role in ROLES}
    engine.apply_weights(policy.trainable_state(), 0)

    env = EnvSpec(name="vowels", roles=(RoleSpec("black"), RoleSpec("white")))
    config = LoopConfig(
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6),
        max_turns=8,
        max_episode_tokens=512,
        role_adapters=True,
    )
    update = UpdateConfig(clip_epsilon=0.2, temperature=1.0)
    for step in range(3):
        requests = [
            EpisodeRequest(f"s{step}-g{g}-{i}", g, 100 * step + g, RoleSession(Vowels()))
            for g in range(2)
            for i in range(4)
        ]
        trajectories, _ = asyncio.run(AgentLoop(engine, config, env).run(requests, seed=step))
        assert sorted(t.role for t in trajectories) == ["black"] * 8 + ["white"] * 8
        episodes = [episode_from_proto(trajectory_to_proto(t)) for t in trajectories]
        assert {e.role for e in episodes} == set(ROLES)
        stats = role_update(policy, episodes, update)
        assert stats.optimizer_steps == 2  # one per role
        engine.apply_weights(policy.trainable_state(), step + 1)
        # The probe covers every role's adapter, and the rollout serves them all.
        expected = policy.probe_logprobs(policy.probe_token_ids)
        served = engine.logprobs_of(policy.probe_token_ids)
        assert len(expected) == len(served) == 2 * (len(policy.probe_token_ids) - 1)
        assert max(abs(a - b) for a, b in zip(expected, served, strict=True)) < 1e-4

    after = {role: lora_tensors(policy, role) for role in ROLES}
    for role in ROLES:
        moved = max(float((after[role][n] - before[role][n]).abs().max()) for n in after[role])
        assert moved > 0, f"{role}'s adapter did not change"
    # The two adapters went different ways: their B matrices (0 at the start) differ.
    gap = max(
        float((after["black"][n] - after["white"][n.replace(".black.", ".white.")]).abs().max())
        for n in after["black"]
        if "lora_B" in n
    )
    assert gap > 0
    # And the two roles' policies differ: their halves of the probe are not the same.
    probe = policy.probe_logprobs(policy.probe_token_ids)
    half = len(probe) // 2
    assert max(abs(a - b) for a, b in zip(probe[:half], probe[half:], strict=True)) > 0

    # A checkpoint keeps each role's adapter; a resumed policy has both back.
    state = checkpoints.TrainerState(
        job_id="j", step=3, policy_version=3, rewards=[0.0] * 3, data_cursor=3
    )
    path = checkpoints.save(policy, state, tmp_path_factory.mktemp("ckpt"), keep=1)
    assert (path / "black" / "adapter_model.safetensors").exists()
    resumed = Policy(spec, learning_rate=5e-2, seed=1)
    resumed.use_role_adapters(ROLES)
    checkpoints.load(resumed, path)
    assert resumed.probe_logprobs(resumed.probe_token_ids) == pytest.approx(probe, abs=1e-6)


def sample(group: int, role: str, reward: float) -> Episode:
    return Episode(group, 0, [1, 2, 3], 1, [0.0, 0.0], [1, 1], reward, False, role=role)


@pytest.mark.unit
def test_advantages_are_grouped_within_a_role() -> None:
    # One game group, two roles: black won both games (1, 1), white lost both (0, 0). Within
    # each role nothing varies, so GRPO gives 0 everywhere; mixing the roles would give +-1.
    episodes = [sample(0, "black", 1.0), sample(0, "white", 0.0)] * 2
    assert episode_advantages(episodes, "grpo").tolist() == [0.0, 0.0, 0.0, 0.0]
    # Without roles (one agent), the same rewards form one group: mean 0.5, std 0.5.
    single = [sample(0, "", r) for r in (1.0, 0.0, 1.0, 0.0)]
    assert episode_advantages(single, "grpo").tolist() == pytest.approx([1, -1, 1, -1], abs=1e-4)
