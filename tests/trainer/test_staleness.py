"""Bounded staleness: the rollout plays the next batch while the trainer trains.

Real EnvHub, real Rollout over gRPC, a recording scheduler (trainer_loop_helpers' mesh). With
max_staleness 1 a job still learns the letter task and every batch is played by the version
one behind the one that trains on it (the first by the same); with 0 none lags. A weight update
sent while a batch is being played applies after it: the batch is all one version.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from identity_service import Identities
from trainer_loop_helpers import job_spec, mesh, run_attempt, run_loop

from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rl.loop import Outcome
from opentinker.services.trainer.rollout_link.rollout_client import GrpcRolloutSession
from opentinker.services.trainer.rollout_link.weight_sync import verified_sync

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_model_dir(letter_model_dir: Path) -> Path:
    return letter_model_dir


def test_staleness_one_learns_and_lags_by_at_most_one(
    identities: Identities, tiny_model_dir: Path, tmp_path: Path
) -> None:
    spec = job_spec(
        tiny_model_dir,
        env_options={"num_letters": "1"},
        steps=30,
        prompts_per_step=4,
        samples_per_prompt=4,
        max_staleness=1,
    )

    async def scenario() -> None:
        async with mesh(identities) as m:
            outcome, _, _ = await run_loop(m, spec, tmp_path)
            assert outcome is Outcome.SUCCEEDED, m.scheduler.of("failure")
            steps = m.scheduler.of("step")
            lags = [s.metrics["off_policy_lag"] for s in steps]
            # batch 0 is played after the first sync (version 0, trained by 0); every later
            # batch k was requested before step k-1 trained, so it was played by version k-1.
            assert lags == [0.0] + [1.0] * (len(steps) - 1), lags
            rewards = [s.metrics["reward_mean"] for s in steps]
            (result,) = m.scheduler.of("result")
            # it learned: ~0.3 (the nudged model answers one of A..D) -> ~0.8 in 30 steps,
            # as the on-policy loop does on the same seed (0.79 at 40 steps).
            first, last = (result.final_metrics[f"reward_mean_{w}10"] for w in ("first", "last"))
            assert last >= first + 0.3, rewards
            assert [s.policy_version for s in steps] == list(range(1, len(steps) + 1))

    asyncio.run(scenario())


def test_staleness_zero_is_strictly_on_policy(
    identities: Identities, tiny_model_dir: Path, tmp_path: Path
) -> None:
    spec = job_spec(tiny_model_dir, steps=3, max_staleness=0)

    async def scenario() -> None:
        async with mesh(identities) as m:
            outcome, _, _ = await run_loop(m, spec, tmp_path)
            assert outcome is Outcome.SUCCEEDED, m.scheduler.of("failure")
            assert [s.metrics["off_policy_lag"] for s in m.scheduler.of("step")] == [0.0] * 3

    asyncio.run(scenario())


def test_staleness_one_resumes_from_a_checkpoint(
    identities: Identities, tiny_model_dir: Path, tmp_path: Path
) -> None:
    spec = job_spec(tiny_model_dir, steps=6, checkpoint_every=2, max_staleness=1)

    async def scenario() -> None:
        async with mesh(identities, stop_at=3, job_id="job-r") as m:
            first = await run_attempt(m, spec, tmp_path / "a1", tmp_path / "ckpt")
            assert first.outcome is Outcome.CANCELLED
        async with mesh(identities, job_id="job-r") as m:
            second = await run_attempt(m, spec, tmp_path / "a2", tmp_path / "ckpt")
            assert second.outcome is Outcome.SUCCEEDED, m.scheduler.of("failure")
            steps = m.scheduler.of("step")
            assert [s.step for s in steps] == [3, 4, 5, 6]  # from the step-2 checkpoint
            assert [s.policy_version for s in steps] == [3, 4, 5, 6]
            # the first batch after the resume is played by the resumed version itself
            assert [s.metrics["off_policy_lag"] for s in steps] == [0.0, 1.0, 1.0, 1.0]

    asyncio.run(scenario())


def test_weights_sent_during_a_collect_apply_after_it(
    identities: Identities, tiny_model_dir: Path
) -> None:
    """Request batch 0, send version 1 at once, then read: batch 0 is all version 0, the
    update is proven afterwards, and batch 1 is all version 1."""
    spec = job_spec(tiny_model_dir, prompts_per_step=8, samples_per_prompt=4)
    assert spec.rl is not None
    torch.manual_seed(0)
    policy = Policy(spec.model, learning_rate=1e-2)

    async def scenario() -> None:
        async with (
            mesh(identities) as m,
            aio_channel(m.rollout_address, credential=m.job_token) as c,
        ):
            rollout = GrpcRolloutSession(c, address=m.rollout_address)
            await rollout.open(job_id="job-1", spec=spec, timeout_s=60)
            await verified_sync(rollout, policy, version=0, tolerance=1e-3, timeout_s=30)
            await rollout.request_batch(batch_index=0, num_groups=8, group_size=4, timeout_s=60)
            with torch.no_grad():  # a different version 1: every LoRA B moves
                for name, p in policy.model.named_parameters():
                    if "lora_B" in name:
                        p.add_(0.05)
            await verified_sync(rollout, policy, version=1, tolerance=1e-3, timeout_s=30)
            first = await rollout.receive_batch(batch_index=0, timeout_s=60)
            assert {e.policy_version for e in first.episodes} == {0}
            second = await rollout.collect(batch_index=1, num_groups=8, group_size=4, timeout_s=60)
            assert {e.policy_version for e in second.episodes} == {1}
            assert m.engines[0].policy_version == 1
            await rollout.close(reason="test done", timeout_s=5)

    asyncio.run(scenario())
