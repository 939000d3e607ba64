"""A shared rollout serving two LoRA jobs on one engine over real gRPC: each job's trainer
syncs only its own adapter (its probe, computed with its adapter, passes), trajectories carry
each job's own version, one job's update never changes the other's outputs, the two jobs'
generate calls merge into one engine call, and a job token reaches only its own job.

Real EnvHub (built-in `letter`), real rollout server, the scheduler's real IdentityService
(tests/support/identity_service.py) vouching for the job tokens; the trainers are real Policies
here.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
import torch
from identity_service import Identities
from rollout_helpers import shared_mesh

from opentinker.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.trainer.errors import RolloutError
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rollout_link.rollout_client import GrpcRolloutSession
from opentinker.services.trainer.rollout_link.weight_sync import verified_sync
from opentinker.spec import JobSpec, LoraConfig, ModelSpec, RlConfig, SamplingParams

pytestmark = pytest.mark.integration

TIMEOUT_S = 60.0


def job_spec(model_dir: Path, *, seed: int) -> JobSpec:
    return JobSpec(
        name="shared",
        model=ModelSpec(base_model=str(model_dir), finetune="lora", lora=LoraConfig(rank=4)),
        rl=RlConfig(
            env_name="letter",
            env_options={"num_letters": "4"},
            steps=1,
            prompts_per_step=2,
            samples_per_prompt=4,
            sampling=SamplingParams(max_new_tokens=2),
            seed=seed,
        ),
    )


def moved_policy(spec: JobSpec, seed: int) -> Policy:
    """A job's trainer policy whose adapter is no longer the base (lora_B drawn non-zero)."""
    policy = Policy(spec.model, learning_rate=1e-2, seed=seed)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return policy


async def score(address: str, token: str, ids: list[int]) -> list[float]:
    async with aio_channel(address, credential=token) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        reply = await stub.ScoreTokens(rollout_pb2.ScoreTokensRequest(token_ids=ids))
    return list(reply.logprobs)


def test_two_jobs_share_one_engine_each_with_its_own_adapter(
    identities: Identities, letter_model_dir: Path
) -> None:
    spec_a, spec_b = job_spec(letter_model_dir, seed=1), job_spec(letter_model_dir, seed=2)
    token_a, token_b = identities.job_token("job-1"), identities.job_token("job-9")
    policy_a = moved_policy(spec_a, seed=1)
    probe = policy_a.probe_token_ids

    async def scenario() -> None:
        # A wide batcher window: under load the two jobs' generate calls can arrive more than
        # the default 50 ms apart, and the merge is what this test checks (a call stops
        # waiting as soon as both jobs have one pending, so the window costs nothing then).
        async with (
            shared_mesh(identities, letter_model_dir, window_s=2.0) as m,
            aio_channel(m.address, credential=token_a) as ca,
            aio_channel(m.address, credential=token_b) as cb,
        ):
            a = GrpcRolloutSession(ca, address=m.address)
            b = GrpcRolloutSession(cb, address=m.address)
            assert await a.open(job_id="job-1", spec=spec_a, timeout_s=TIMEOUT_S) == (
                "transformers-multi-lora"
            )
            await b.open(job_id="job-9", spec=spec_b, timeout_s=TIMEOUT_S)
            assert sorted(m.shared.jobs) == ["job-1", "job-9"]
            b_before = await score(m.address, token_b, probe)

            # job-1's verified sync: its probe is scored with its own adapter, and passes
            result = await verified_sync(
                a, policy_a, version=1, tolerance=1e-4, timeout_s=TIMEOUT_S
            )
            assert result.probe_diff <= 1e-4
            assert await score(m.address, token_a, probe) == pytest.approx(
                policy_a.probe_logprobs(probe), abs=1e-4
            )
            # ... and job-9's outputs did not move at all
            assert await score(m.address, token_b, probe) == b_before
            assert b_before != pytest.approx(policy_a.probe_logprobs(probe), abs=1e-3)

            # both collect at once: one engine call serves both, each stamped with its version
            batch_a, batch_b = await asyncio.gather(
                a.collect(batch_index=0, num_groups=2, group_size=4, timeout_s=TIMEOUT_S),
                b.collect(batch_index=0, num_groups=2, group_size=4, timeout_s=TIMEOUT_S),
            )
            assert {e.policy_version for e in batch_a.episodes} == {1}
            assert {e.policy_version for e in batch_b.episodes} == {0}
            assert max(m.shared.batcher.stats.calls_merged) == 2, m.shared.batcher.stats
            await a.close(reason="done", timeout_s=TIMEOUT_S)
            await b.close(reason="done", timeout_s=TIMEOUT_S)
            # The streams' ends free both adapters (in a worker thread: under load it can take
            # seconds, so wait up to the test's own timeout rather than a fixed 2.5 s).
            deadline = time.monotonic() + TIMEOUT_S
            while m.shared.engine.adapters and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert m.shared.jobs == [] and m.shared.engine.adapters == []

    asyncio.run(scenario())


def test_a_job_token_reaches_only_its_own_job(
    identities: Identities, letter_model_dir: Path
) -> None:
    spec = job_spec(letter_model_dir, seed=1)

    async def scenario() -> None:
        async with shared_mesh(identities, letter_model_dir, capacity=2) as m:
            # job-1's token cannot open job-9
            async with aio_channel(m.address, credential=identities.job_token("job-1")) as c:
                with pytest.raises(RolloutError, match="PERMISSION_DENIED.*belongs to job job-1"):
                    await GrpcRolloutSession(c, address=m.address).open(
                        job_id="job-9", spec=spec, timeout_s=TIMEOUT_S
                    )
            # a user's API key cannot open a stream on a shared engine at all
            async with aio_channel(m.address, credential=identities.user_key) as c:
                with pytest.raises(RolloutError, match="PERMISSION_DENIED"):
                    await GrpcRolloutSession(c, address=m.address).open(
                        job_id="job-1", spec=spec, timeout_s=TIMEOUT_S
                    )
            # job-9 opens; job-1 cannot score with job-9's adapter (it has none of its own)
            async with aio_channel(m.address, credential=identities.job_token("job-9")) as c9:
                await GrpcRolloutSession(c9, address=m.address).open(
                    job_id="job-9", spec=spec, timeout_s=TIMEOUT_S
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await score(m.address, identities.job_token("job-1"), [1, 2, 3])
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert len(await score(m.address, identities.job_token("job-9"), [1, 2, 3])) == 2
                # a second stream of job-9 is refused while the first is open
                with pytest.raises(RolloutError, match="already has a Rollout stream"):
                    await GrpcRolloutSession(c9, address=m.address).open(
                        job_id="job-9", spec=spec, timeout_s=TIMEOUT_S
                    )
                # another base model cannot join this engine
                other = spec.model_copy(
                    update={"model": spec.model.model_copy(update={"base_model": "/elsewhere"})}
                )
                async with aio_channel(m.address, credential=identities.job_token("job-r")) as cr:
                    with pytest.raises(RolloutError, match="serves base model"):
                        await GrpcRolloutSession(cr, address=m.address).open(
                            job_id="job-r", spec=other, timeout_s=TIMEOUT_S
                        )
                assert m.shared.jobs == ["job-9"]

    asyncio.run(scenario())


def test_a_full_engine_refuses_the_next_job(identities: Identities, letter_model_dir: Path) -> None:
    spec = job_spec(letter_model_dir, seed=1)

    async def scenario() -> None:
        async with (
            shared_mesh(identities, letter_model_dir, capacity=1) as m,
            aio_channel(m.address, credential=identities.job_token("job-1")) as c1,
            aio_channel(m.address, credential=identities.job_token("job-9")) as c9,
        ):
            await GrpcRolloutSession(c1, address=m.address).open(
                job_id="job-1", spec=spec, timeout_s=TIMEOUT_S
            )
            with pytest.raises(RolloutError, match="RESOURCE_EXHAUSTED.*serves 1 adapters"):
                await GrpcRolloutSession(c9, address=m.address).open(
                    job_id="job-9", spec=spec, timeout_s=TIMEOUT_S
                )

    asyncio.run(scenario())
