"""The trainer's RL loop against the real mesh (trainer_loop_helpers.py): EnvHub (built-in
`letter` env) + Rollout service as real gRPC servers on 127.0.0.1:0 in this process, and a
recording SchedulerService.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import grpc
import pytest
import torch
from identity_service import Identities
from peft import PeftModel
from trainer_loop_helpers import job_spec, mesh, run_loop
from transformers import AutoModelForCausalLM

from opentinker.common.v1 import common_pb2
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.common.launch import LaunchConfig, wait_for_file
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.trainer.rl.loop import Outcome
from opentinker.services.trainer.rollout_link.weight_sync import (
    ProbeShift,
    ProbeShiftWatch,
    SyncResult,
)
from opentinker.services.trainer.settings import TrainerSettings
from opentinker.spec import to_proto
from opentinker.trainer.v1 import trainer_pb2, trainer_pb2_grpc

pytestmark = pytest.mark.integration

REQUIRED_METRICS = {
    "reward_mean", "reward_std", "loss", "entropy", "clip_fraction", "grad_norm", "tokens_per_s",
    "completion_len_mean", "env_errors", "time_generate_s", "time_env_s", "time_train_s",
    "time_weight_sync_s", "time_step_s", "time_mesh_s", "tokens_generated", "tokens_trained",
    "episodes_truncated_frac", "padding_share", "probe_shift", "probe_blind_versions",
    "time_train_forward_backward_s", "time_train_optimizer_s", "memory_resident_gib",
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model_dir(letter_model_dir: Path) -> Path:
    return letter_model_dir


class WeightIgnoringEngine(TransformersEngine):
    """A broken engine: claims every update but keeps serving its own weights."""

    def apply_weights(self, tensors: Mapping[str, torch.Tensor], policy_version: int) -> None:
        self.policy_version = policy_version


class VersionLaggingEngine(TransformersEngine):
    """Applies weights but stamps trajectories with the previous version (a stale-cache bug)."""

    def apply_weights(self, tensors: Mapping[str, torch.Tensor], policy_version: int) -> None:
        super().apply_weights(tensors, policy_version)
        self.policy_version = policy_version - 1


def test_the_probe_warning_needs_an_update_that_had_a_gradient() -> None:
    """A batch whose rewards were all equal has no gradient: nothing moved, so a probe that
    saw no shift is no news (the demo's first steps); the first update with a gradient that
    the probe cannot see is told, once."""
    watch = ProbeShiftWatch()
    assert watch.warning(ProbeShift(0.0, 1), 1e-3, 1, had_gradient=False) is None
    told = watch.warning(ProbeShift(1e-4, 1), 1e-3, 2, had_gradient=True)
    assert told is not None and "step 2's update" in told and "probe_blind_versions" in told
    assert watch.warning(ProbeShift(0.0, 1), 1e-3, 3, had_gradient=True) is None  # once per job
    assert ProbeShiftWatch().warning(ProbeShift(2e-3, 0), 1e-3, 4, had_gradient=True) is None


def test_blind_versions_count_back_to_the_newest_version_the_probe_tells_apart() -> None:
    """Updates that each move the probe 0.02 against a tolerance of 0.05 (as one LoRA step of
    a 0.5B model in bf16 moved it 0.025 against 0.05 on an H100): each sync cannot tell the
    last two versions from its own, the third back it can; a larger update, none; never more
    than the window's versions."""

    def sync(value: float) -> SyncResult:
        return SyncResult(seconds=0.0, probe_diff=0.0, probe_logprobs=(-1.0, value), tolerance=0.05)

    watch = ProbeShiftWatch(window=4)
    assert watch.shift(sync(0.0), version=0) is None  # the first sync: nothing to compare
    seen = [watch.shift(sync(0.02 * v), version=v) for v in range(1, 6)]
    assert [s.blind_versions for s in seen if s] == [1, 2, 2, 2, 2]
    assert all(s and s.shift == pytest.approx(0.02) for s in seen)
    jump = watch.shift(sync(1.0), version=6)
    assert jump == ProbeShift(pytest.approx(0.9), 0)
    still = ProbeShiftWatch(window=3)
    blind = [still.shift(sync(0.0), version=v) for v in range(6)]
    assert [s.blind_versions for s in blind if s] == [1, 2, 3, 3, 3]  # the window's at most


def test_an_update_too_small_for_the_probe_to_see_is_reported_once(
    identities: Identities, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """At a learning rate of 1e-9 no update moves the probe past its 1e-3 tolerance, so a
    sync could not tell stale weights from new ones: the job still runs, its probe_shift
    says so every step, and the user is told once."""
    spec = job_spec(tiny_model_dir, learning_rate=1e-9)

    async def scenario() -> None:
        async with mesh(identities) as m:
            outcome, _, _ = await run_loop(m, spec, tmp_path)
            assert outcome is Outcome.SUCCEEDED, m.scheduler.of("failure")
            steps = m.scheduler.of("step")
            assert len(steps) == 3 and all(s.metrics["probe_shift"] < 1e-3 for s in steps)
            # no sync could tell its version from any earlier one
            assert [s.metrics["probe_blind_versions"] for s in steps] == [1.0, 2.0, 3.0]
            told = [log.message for log in m.scheduler.of("log") if "could not tell" in log.message]
            assert len(told) == 1 and "step 1's update" in told[0], told

    asyncio.run(scenario())


def test_a_slow_rollout_open_is_told_to_the_user(
    identities: Identities, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """An open still loading after slow_open_notice_s (0 s here: every open; vLLM's first
    start on a GPU takes a minute or more) is told in the job's events before its first step,
    then how long it took. A quick open (under the default 10 s, as in the other tests) says
    nothing."""
    spec = job_spec(tiny_model_dir)

    async def scenario() -> None:
        async with mesh(identities) as m:
            outcome, _, _ = await run_loop(m, spec, tmp_path, slow_open_notice_s=0.0)
            assert outcome is Outcome.SUCCEEDED, m.scheduler.of("failure")
            kinds = [r.WhichOneof("payload") for r in m.scheduler.reports]
            assert kinds[:2] == ["log", "log"] and kinds[2] == "step", kinds
            loading, ready = (log.message for log in m.scheduler.of("log")[:2])
            assert loading.startswith(f"the rollout is loading {tiny_model_dir} ")
            assert re.fullmatch(r"rollout ready: transformers engine after \d+ s", ready), ready

    asyncio.run(scenario())


def test_loop_trains_syncs_reports_and_checkpoints(
    identities: Identities, tiny_model_dir: Path, tmp_path: Path
) -> None:
    spec = job_spec(tiny_model_dir, checkpoint_every=2)

    async def scenario() -> None:
        async with mesh(identities) as m:
            outcome, policy, initial = await run_loop(m, spec, tmp_path)
            assert outcome is Outcome.SUCCEEDED, m.scheduler.of("failure")
            # parameters changed (LoRA B starts at zero: any step moves it)
            final = policy.trainable_state()
            assert any(not torch.equal(initial[n], final[n]) for n in initial)
            # the rollout serves exactly the trainer's final weights, as version 3
            engine = m.engines[0]
            assert engine.policy_version == 3
            served = dict(engine.model.named_parameters())
            assert all(torch.equal(served[n], t) for n, t in final.items())
            # one report per step, every required metric, versions 1..3
            steps = m.scheduler.of("step")
            assert [s.step for s in steps] == [1, 2, 3]
            assert [s.policy_version for s in steps] == [1, 2, 3]
            for s in steps:
                assert set(s.metrics) >= REQUIRED_METRICS, REQUIRED_METRICS - set(s.metrics)
                assert 0.0 <= s.metrics["reward_mean"] <= 1.0
                assert s.metrics["env_errors"] == 0.0
                assert s.metrics["probe_max_abs_diff"] <= 1e-3
                # each update moved the probe past the tolerance: the sync told versions apart
                assert s.metrics["probe_shift"] > 1e-3
                assert s.metrics["probe_blind_versions"] == 0.0
                assert s.metrics["time_step_s"] >= s.metrics["time_train_s"] > 0
                assert 0.05 < s.metrics["memory_resident_gib"] < 64  # this process, torch in it
                # the update's passes (none when no episode had signal) and optimizer steps,
                # parts of its training time
                passes = s.metrics["time_train_forward_backward_s"]
                optimizer = s.metrics["time_train_optimizer_s"]
                assert optimizer > 0 and passes + optimizer <= s.metrics["time_train_s"]
                assert (passes > 0) == (s.metrics["tokens_trained"] > 0), s.metrics
                assert 1.0 <= s.metrics["completion_len_mean"] <= 2.0  # max_new_tokens 2
                # 8 episodes x 1-2 tokens each; trained tokens are model tokens with signal.
                assert 8 <= s.metrics["tokens_generated"] <= 16
                assert 0 <= s.metrics["tokens_trained"] <= s.metrics["tokens_generated"]
            assert [r.job_id for r in m.scheduler.reports] == ["job-1"] * 4
            (result,) = m.scheduler.of("result")
            assert result.final_metrics["steps"] == 3.0
            assert result.final_metrics["policy_version"] == 3.0
            assert set(result.final_metrics) >= {"reward_mean_first10", "reward_mean_last10"}
            assert not m.scheduler.of("failure")
            assert not m.scheduler.of("log")  # nothing to tell: the open was quick
            # final + intermediate checkpoints, in HF/PEFT format, with what resuming needs
            ckpt = Path(result.checkpoint_uri)
            assert (
                ckpt.is_absolute() and ckpt == (tmp_path / "checkpoints" / "step-000003").resolve()
            )
            assert (tmp_path / "checkpoints" / "step-000002" / "adapter_config.json").exists()
            assert {"optimizer.pt", "rng.pt", "trainer_state.json", "manifest.json"} <= {
                p.name for p in ckpt.iterdir()
            }
            base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
            reloaded = PeftModel.from_pretrained(base, ckpt).eval()
            ids = torch.tensor([policy.probe_token_ids])
            lp = torch.log_softmax(reloaded(input_ids=ids).logits[0, :-1], -1)
            lp = lp.gather(-1, ids[0, 1:, None]).squeeze(-1)
            expected = torch.tensor(policy.probe_logprobs(policy.probe_token_ids))
            assert torch.allclose(lp, expected, atol=1e-5)

    asyncio.run(scenario())


def test_a_rollout_that_ignores_weights_fails_the_job(
    identities: Identities, tiny_model_dir: Path, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with mesh(identities, WeightIgnoringEngine) as m:
            outcome, _, _ = await run_loop(m, job_spec(tiny_model_dir), tmp_path)
            assert outcome is Outcome.FAILED
            (failure,) = m.scheduler.of("failure")
            # v0 passes (LoRA B = 0: adapter is a no-op on both sides); v1 must not
            assert "rollout serves stale/different weights: max |Δlogprob| =" in failure.reason
            assert "policy version 1" in failure.reason
            assert "torch.float32 logits of std" in failure.reason  # what the tolerance is of
            assert [s.step for s in m.scheduler.of("step")] == []
            assert not m.scheduler.of("result")

    asyncio.run(scenario())


def test_off_policy_trajectories_fail_the_job(
    identities: Identities, tiny_model_dir: Path, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with mesh(identities, VersionLaggingEngine) as m:
            outcome, _, _ = await run_loop(m, job_spec(tiny_model_dir), tmp_path)
            assert outcome is Outcome.FAILED
            (failure,) = m.scheduler.of("failure")
            assert "off-policy trajectories" in failure.reason
            assert "generated by policy version -1" in failure.reason

    asyncio.run(scenario())


def test_an_unknown_env_fails_the_job_naming_it(
    identities: Identities, tiny_model_dir: Path, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with mesh(identities) as m:
            spec = job_spec(tiny_model_dir, env_name="no-such-env")
            outcome, _, _ = await run_loop(m, spec, tmp_path)
            assert outcome is Outcome.FAILED
            (failure,) = m.scheduler.of("failure")
            assert failure.reason.startswith("rollout failed")
            assert "no-such-env" in failure.reason

    asyncio.run(scenario())


def test_a_dead_rollout_fails_the_job_within_seconds(
    identities: Identities, tiny_model_dir: Path, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with mesh(identities) as m:
            started = time.monotonic()
            dead = "127.0.0.1:9"  # discard port: nothing listens
            outcome, _, _ = await run_loop(
                m, job_spec(tiny_model_dir), tmp_path, rollout_address=dead
            )
            assert outcome is Outcome.FAILED
            assert time.monotonic() - started < 15
            (failure,) = m.scheduler.of("failure")
            assert "rollout at 127.0.0.1:9" in failure.reason and "UNAVAILABLE" in failure.reason

    asyncio.run(scenario())


def test_cancel_from_the_scheduler_stops_cleanly(
    identities: Identities, tiny_model_dir: Path, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with mesh(identities, stop_at=1) as m:
            outcome, _, _ = await run_loop(m, job_spec(tiny_model_dir, steps=5), tmp_path)
            assert outcome is Outcome.CANCELLED
            assert [s.step for s in m.scheduler.of("step")] == [1]
            assert not m.scheduler.of("result") and not m.scheduler.of("failure")
            # no checkpoint: the folder is there (checked writable before step 1), empty
            assert list((tmp_path / "checkpoints").iterdir()) == []

    asyncio.run(scenario())


def test_stop_at_reward_ends_the_job_early(
    identities: Identities, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # a target of -1 is always reached, but only once a full window of 10 steps exists
    spec = job_spec(tiny_model_dir, steps=12, stop_at_reward=-1.0, prompts_per_step=1)

    async def scenario() -> None:
        async with mesh(identities) as m:
            outcome, _, _ = await run_loop(m, spec, tmp_path)
            assert outcome is Outcome.SUCCEEDED
            assert len(m.scheduler.of("step")) == 10
            (result,) = m.scheduler.of("result")
            assert result.final_metrics["steps"] == 10.0

    asyncio.run(scenario())


@pytest.mark.slow
def test_trainer_process_serves_status_and_exits_zero(
    identities: Identities, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`python -m opentinker.services.trainer` end to end, as the worker agent starts it."""
    spec = job_spec(tiny_model_dir, steps=2)
    job = common_pb2.Job(job_id="job-proc", spec=to_proto(spec), attempt=1)

    async def scenario() -> None:
        async with mesh(identities, job_id="job-proc") as m:
            launch = LaunchConfig.for_job(
                job,
                lease_id="lease-1",
                device_ids=["cpu:0"],
                scheduler_address=m.scheduler_address,
                envhub_address="unused",
                run_dir=tmp_path,
                job_token=m.job_token,
            )
            launch.write(tmp_path / "launch.json")
            assert (tmp_path / "launch.json").stat().st_mode & 0o777 == 0o600  # holds a secret
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "opentinker.services.trainer",
                "--launch", str(tmp_path / "launch.json"), "--rollout-address", m.rollout_address,
            )  # fmt: skip
            addr = await asyncio.to_thread(
                wait_for_file, tmp_path / "trainer.addr", timeout_s=60,
                alive=lambda: proc.returncode is None,
            )  # fmt: skip
            async with aio_channel(addr) as anonymous:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await trainer_pb2_grpc.TrainerServiceStub(anonymous).GetTrainerStatus(
                        trainer_pb2.GetTrainerStatusRequest(), timeout=5
                    )
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            async with aio_channel(addr, credential=m.job_token) as channel:
                stub = trainer_pb2_grpc.TrainerServiceStub(channel)
                status = await stub.GetTrainerStatus(
                    trainer_pb2.GetTrainerStatusRequest(), timeout=5
                )
                assert status.job_id == "job-proc"
                assert status.finetune == common_pb2.FINETUNE_MODE_LORA
            code = await asyncio.wait_for(proc.wait(), timeout=120)
            assert code == 0, m.scheduler.of("failure")
            assert [s.step for s in m.scheduler.of("step")] == [1, 2]
            assert m.scheduler.of("result")[0].final_metrics["policy_version"] == 2.0

    asyncio.run(scenario())


def test_trainer_status_reports_progress_over_grpc(
    identities: Identities, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from opentinker.services.common.auth import OwnCredentialAuthenticator
    from opentinker.services.trainer.rl.loop import TrainerStatus
    from opentinker.services.trainer.service import create_server

    token = identities.job_token("job-9")

    async def scenario() -> None:
        status = TrainerStatus(job_id="job-s", finetune="full", trainable_parameters=42)
        authenticator = OwnCredentialAuthenticator(token, job_id="job-9", attempt=1)
        server, port = await create_server(TrainerSettings(), status, authenticator=authenticator)
        try:
            status.step, status.policy_version, status.last_metrics = 5, 5, {"loss": 0.25}
            async with aio_channel(f"127.0.0.1:{port}", credential=token) as channel:
                stub = trainer_pb2_grpc.TrainerServiceStub(channel)
                reply = await stub.GetTrainerStatus(
                    trainer_pb2.GetTrainerStatusRequest(), timeout=5
                )
            assert (reply.job_id, reply.step, reply.policy_version) == ("job-s", 5, 5)
            assert reply.finetune == common_pb2.FINETUNE_MODE_FULL
            assert reply.trainable_parameters == 42 and reply.last_metrics["loss"] == 0.25
        finally:
            await server.stop(grace=0.1)

    asyncio.run(scenario())
