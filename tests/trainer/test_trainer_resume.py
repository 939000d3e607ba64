"""A job resumed from a checkpoint continues step for step like an uninterrupted one.

Real EnvHub + Rollout gRPC servers and the real RL loop (trainer_loop_helpers' mesh). LoRA
dropout is on, so the trainer draws from torch's RNG every step: the resumed steps match only
if the checkpoint restored the RNG state as well as the weights and AdamW moments.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from identity_service import Identities
from trainer_loop_helpers import RecordingScheduler, job_spec, mesh, run_attempt

from opentinker.services.trainer import checkpoints
from opentinker.services.trainer.rl.loop import Outcome
from opentinker.spec import JobSpec, LoraConfig, ModelSpec

pytestmark = pytest.mark.integration

STEPS = 4
CHECKPOINT_EVERY = 2
TOLERANCE = 1e-6  # float32 on one CPU: the same ops in the same order


# PPO resumes its critic (value head + its AdamW) and continues the LR schedule; the KL term's
# reference (the base: LoRA with the adapter disabled) needs no state.
PPO = {
    "loss": "ppo",
    "critic_learning_rate": 1e-2,
    "ppo_epochs": 2,
    "kl_coef": 0.05,
    "warmup_steps": 2,
    "lr_schedule": "cosine",
}


def spec_with_dropout(model_dir: Path, **rl: object) -> JobSpec:
    # Strictly on-policy (max_staleness 0): with staleness 1 the batch after a resume is played
    # by the resumed version, where the uninterrupted run played it with the version before.
    spec = job_spec(
        model_dir,
        steps=STEPS,
        checkpoint_every=CHECKPOINT_EVERY,
        prompts_per_step=4,
        max_staleness=0,
        **rl,
    )
    lora = LoraConfig(rank=4, dropout=0.2)
    return spec.model_copy(
        update={"model": ModelSpec(base_model=str(model_dir), finetune="lora", lora=lora)}
    )


COMPARED = (
    "loss", "grad_norm", "entropy", "logprob_gap", "reward_mean", "kl", "value_loss", "lr",
)  # fmt: skip


def figures(scheduler: RecordingScheduler) -> dict[int, dict[str, float]]:
    """Step -> the figures of that step that depend on weights, optimizer and RNG."""
    return {s.step: {k: s.metrics[k] for k in COMPARED} for s in scheduler.of("step")}


def plant_broken_checkpoints(folder: Path) -> None:
    """What a crash can leave: a hidden folder being written, a checkpoint with a bad file."""
    good = folder / "step-000002"
    shutil.copytree(good, folder / ".step-000003.tmp-999")
    broken = folder / "step-000003"
    shutil.copytree(good, broken)
    state = json.loads((broken / "trainer_state.json").read_text())
    (broken / "trainer_state.json").write_text(json.dumps({**state, "step": 3}))  # size differs


@pytest.mark.parametrize("algorithm", [{}, PPO], ids=["grpo", "ppo"])
def test_a_resumed_run_matches_the_uninterrupted_one(
    identities: Identities, letter_model_dir: Path, tmp_path: Path, algorithm: dict
) -> None:
    spec = spec_with_dropout(letter_model_dir, **algorithm)

    async def scenario() -> None:
        async with mesh(identities, job_id="job-r") as m:
            straight = await run_attempt(m, spec, tmp_path / "a", tmp_path / "ckpt-a")
            assert straight.outcome is Outcome.SUCCEEDED, m.scheduler.of("failure")
            expected = figures(m.scheduler)
            (expected_result,) = m.scheduler.of("result")
        # The interrupted job: stopped after step 3, one step past its step-2 checkpoint
        # (the cancel path saves nothing, like a crash).
        async with mesh(identities, stop_at=3, job_id="job-r") as m:
            first = await run_attempt(m, spec, tmp_path / "b1", tmp_path / "ckpt-b")
            assert first.outcome is Outcome.CANCELLED
            assert sorted(figures(m.scheduler)) == [1, 2, 3]
        plant_broken_checkpoints(tmp_path / "ckpt-b")
        async with mesh(
            identities, job_id="job-r"
        ) as m:  # a new attempt: fresh rollout, fresh policy and optimizer
            second = await run_attempt(m, spec, tmp_path / "b2", tmp_path / "ckpt-b")
            assert second.outcome is Outcome.SUCCEEDED, m.scheduler.of("failure")
            (resumed_log,) = m.scheduler.of("log")
            assert resumed_log.message.startswith("resumed from checkpoint step-000002 (step 2")
            steps = m.scheduler.of("step")
            assert [s.step for s in steps] == [3, 4]
            assert [s.policy_version for s in steps] == [3, 4]
            resumed = figures(m.scheduler)
            (result,) = m.scheduler.of("result")

        # both resumed steps trained (some group had mixed rewards), so they test something
        assert all(expected[k]["grad_norm"] > 0 for k in (3, 4)), expected
        for k in (3, 4):
            for name in COMPARED:
                got, want = resumed[k][name], expected[k][name]
                assert got == pytest.approx(want, abs=TOLERANCE), (k, name, got, want)
        for name, want in straight.policy.trainable_state().items():
            got = second.policy.trainable_state()[name]
            assert torch.allclose(got, want, atol=1e-6, rtol=0), name
        # the reward history came back too: the whole-run metrics are the same
        for key in ("reward_mean_first10", "reward_mean_last10", "steps", "policy_version"):
            assert result.final_metrics[key] == pytest.approx(expected_result.final_metrics[key])
        assert not (tmp_path / "ckpt-b" / ".step-000003.tmp-999").exists()
        assert not (tmp_path / "ckpt-b" / "step-000003").exists()  # half-made: deleted
        kept = checkpoints.complete_checkpoints(tmp_path / "ckpt-b")
        assert [p.name for p in kept] == ["step-000002", "step-000004"]
        assert Path(result.checkpoint_uri) == kept[-1]

    asyncio.run(scenario())


def test_an_attempt_resumed_after_the_target_reward_trains_no_further(
    identities: Identities, letter_model_dir: Path, tmp_path: Path
) -> None:
    """An attempt that reached stop_at_reward saved its final checkpoint and was lost before
    its result reached the scheduler (killed during the final validation): the next attempt
    resumes at the target and reports the same result, with no step beyond it."""
    spec = job_spec(letter_model_dir, steps=12, stop_at_reward=-1.0, prompts_per_step=1)

    async def scenario() -> None:
        async with mesh(identities, job_id="job-r") as m:
            first = await run_attempt(m, spec, tmp_path / "a1", tmp_path / "ckpt")
            assert first.outcome is Outcome.SUCCEEDED, m.scheduler.of("failure")
            assert len(m.scheduler.of("step")) == 10
        async with mesh(identities, job_id="job-r") as m:
            again = await run_attempt(m, spec, tmp_path / "a2", tmp_path / "ckpt")
            assert again.outcome is Outcome.SUCCEEDED, m.scheduler.of("failure")
            assert m.scheduler.of("step") == []
            (result,) = m.scheduler.of("result")
            assert result.final_metrics["steps"] == 10.0
        kept = checkpoints.complete_checkpoints(tmp_path / "ckpt")
        assert kept[-1].name == "step-000010" and Path(result.checkpoint_uri) == kept[-1]

    asyncio.run(scenario())
