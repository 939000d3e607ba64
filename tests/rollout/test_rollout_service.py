"""RolloutService end to end over real gRPC: a real env server behind a real EnvHub, the tiny
model, and the test playing the trainer (open, weight sync with probe, batches, bad input),
and the rollout process itself (address file, health, SIGTERM). When the environment fails:
test_rollout_env_faults.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from identity_service import Identities
from rollout_service_helpers import Trainer, mesh, open_request, run, trainer_replica

from opentinker.common.v1 import common_pb2
from opentinker.rollout.v1 import rollout_pb2
from opentinker.services.common.launch import LaunchConfig, wait_for_file
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.modeling.weights import pack_weights
from opentinker.services.rollout.service import TRAINER_LEFT

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


def test_open_sync_weights_with_probe_collect_groups_and_close(model_dir: Path) -> None:
    async def scenario() -> None:
        async with mesh() as m:
            trainer = Trainer(m.rollout_address)
            try:
                opened = (await trainer.open(model_dir)).opened
                assert (opened.engine, opened.policy_version) == ("transformers", 0)

                await trainer.send(heartbeat=common_pb2.Heartbeat(time_unix_s=time.time()))
                assert (await trainer.recv()).heartbeat.time_unix_s > 0

                # Weight sync: only the adapter travels, in several chunks; the probe proves it.
                policy = trainer_replica(model_dir)
                adapter = {n: p.detach() for n, p in policy.named_parameters() if p.requires_grad}
                probe = list(range(40, 80))
                with torch.no_grad():
                    logits = policy(input_ids=torch.tensor([probe])).logits[0, :-1]
                    expected = torch.log_softmax(logits, -1).gather(
                        -1, torch.tensor(probe[1:])[:, None]
                    )
                chunks = list(
                    pack_weights(
                        adapter,
                        policy_version=1,
                        is_adapter=True,
                        probe_token_ids=probe,
                        max_chunk_bytes=4096,
                    )
                )
                assert len(chunks) > 2
                for chunk in chunks:
                    await trainer.send(weights=chunk)
                applied = (await trainer.recv()).applied
                assert applied.policy_version == 1 and applied.apply_seconds > 0
                assert list(applied.probe_logprobs) == pytest.approx(
                    expected[:, 0].tolist(), abs=1e-4
                )

                # A batch: 2 groups x 3 samples; a group shares its prompt. A heartbeat sent
                # while it is being collected is answered first: generation is off the loop.
                await trainer.send(
                    collect=rollout_pb2.CollectTrajectories(
                        batch_index=4, num_groups=2, group_size=3
                    )
                )
                await trainer.send(heartbeat=common_pb2.Heartbeat(time_unix_s=time.time()))
                assert (await trainer.recv()).WhichOneof("payload") == "heartbeat"
                batch = (await trainer.recv()).batch
                assert batch.batch_index == 4 and len(batch.trajectories) == 6
                ids = [t.episode_id for t in batch.trajectories]
                assert ids == [f"job-1-b4-g{g}-s{i}" for g in range(2) for i in range(3)]
                prompts = {}
                for t in batch.trajectories:
                    prompt = tuple(t.token_ids[: t.prompt_length])
                    prompts.setdefault(t.group_index, set()).add(prompt)
                    assert t.policy_version == 1
                    assert len(t.logprobs) == len(t.loss_mask) == len(t.token_ids) - t.prompt_length
                    assert t.finish_reason == rollout_pb2.FINISH_REASON_ENV_DONE
                    assert (t.num_turns, t.reward, t.env_retries) == (2, 1.0, 0)
                    assert t.info["outcome"] == "win" and t.info["last"].isdigit()
                    assert "<|im_start|>user\nNow " in t.completion_text
                    assert all(
                        lp < 0 for lp, mask in zip(t.logprobs, t.loss_mask, strict=True) if mask
                    )
                    assert all(
                        lp == 0
                        for lp, mask in zip(t.logprobs, t.loss_mask, strict=True)
                        if not mask
                    )
                assert all(len(p) == 1 for p in prompts.values()), "one prompt per group"
                assert prompts[0] != prompts[1], "groups get different prompts"
                assert batch.generated_tokens == sum(sum(t.loss_mask) for t in batch.trajectories)
                assert batch.generate_seconds > 0 and batch.env_seconds > 0
                # Batch 4's episodes are closed on the env server (the closes follow the batch,
                # not awaited), and batch 5's are already reset, while the trainer trains on 4.
                deadline = time.monotonic() + 30
                while len(m.env.table) != 6 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert len(m.env.table) == 6

                await trainer.send(close=rollout_pb2.CloseRollout(reason="done"))
                assert (await trainer.recv()).closed.reason == "done"
                assert await trainer.ended()
                # The stream's end closed the episodes reset ahead: nothing is left open.
                deadline = time.monotonic() + 30
                while len(m.env.table) and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert len(m.env.table) == 0
                assert [r.seq for r in trainer.replies] == list(range(1, len(trainer.replies) + 1))
            finally:
                await trainer.close()

    run(scenario())


def test_bad_client_input_is_refused_with_a_reason(model_dir: Path) -> None:
    async def scenario() -> None:
        async with mesh() as m:

            async def failure(*steps: dict) -> rollout_pb2.RolloutFailed:
                trainer = Trainer(m.rollout_address)
                try:
                    for step in steps:
                        if step.get("open") is True:
                            assert (await trainer.open(model_dir)).WhichOneof("payload") == "opened"
                        else:
                            await trainer.send(**step)
                    reply = await trainer.recv()
                    assert reply.WhichOneof("payload") == "failed"
                    assert await trainer.ended()
                    return reply.failed
                finally:
                    await trainer.close()

            early = await failure(
                {"collect": rollout_pb2.CollectTrajectories(num_groups=1, group_size=2)}
            )
            assert early.code == "FAILED_PRECONDITION" and "OpenRollout" in early.reason

            piece = common_pb2.Tensor(
                name="w",
                shape=[4],
                dtype=common_pb2.D_TYPE_FLOAT32,
                data=b"\0" * 16,
                byte_offset=8,
                total_bytes=16,
            )
            bad_chunk = rollout_pb2.WeightChunk(policy_version=1, tensors=[piece], last=True)
            malformed = await failure({"open": True}, {"weights": bad_chunk})
            assert malformed.code == "INVALID_ARGUMENT" and "'w'" in malformed.reason

            twice = await failure({"open": True}, {"open": open_request(model_dir)})
            assert twice.code == "FAILED_PRECONDITION" and "once" in twice.reason

            unknown = next(
                pack_weights({"no.such.tensor": torch.zeros(3)}, policy_version=1, is_adapter=True)
            )
            refused = await failure({"open": True}, {"weights": unknown})
            assert refused.code == "INVALID_ARGUMENT" and "no.such.tensor" in refused.reason

            trainer = Trainer(m.rollout_address)
            try:
                reply = await trainer.open(model_dir, max_episode_tokens=-3, env_name="")
                assert reply.failed.code == "INVALID_ARGUMENT"
                assert (
                    "max_episode_tokens" in reply.failed.reason
                    and "env_name" in reply.failed.reason
                )
            finally:
                await trainer.close()

    run(scenario())


def test_a_trainer_that_leaves_its_stream_unclosed_is_lost(model_dir: Path) -> None:
    """A stream closed with CloseRollout ends as agreed; one whose trainer vanished (the call
    cut, as keepalive cuts a stopped trainer's) is reported lost, and a private rollout's main
    then exits PEER_LOST for the worker to end the attempt (test_e2e_hangs.py)."""

    async def scenario() -> None:
        lost: list[str] = []
        async with mesh(on_trainer_lost=lost.append) as m:
            closing = Trainer(m.rollout_address)
            try:
                assert (await closing.open(model_dir)).WhichOneof("payload") == "opened"
                await closing.send(close=rollout_pb2.CloseRollout(reason="trainer finished"))
                assert (await closing.recv()).WhichOneof("payload") == "closed"
            finally:
                await closing.close()
            leaving = Trainer(m.rollout_address)
            assert (await leaving.open(model_dir)).WhichOneof("payload") == "opened"
            await leaving.close()  # gone without a CloseRollout
            deadline = time.monotonic() + 10
            while not lost and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        assert lost == [TRAINER_LEFT]

    run(scenario())


def test_main_writes_its_address_serves_health_and_stops_on_sigterm(
    identities: Identities, tmp_path: Path
) -> None:
    job = common_pb2.Job(job_id="job-9")
    launch = LaunchConfig.for_job(
        job,
        lease_id="lease-1",
        device_ids=[],
        scheduler_address="127.0.0.1:1",
        envhub_address="127.0.0.1:2",
        run_dir=tmp_path,
        job_token=identities.job_token("job-9"),
    )
    launch.write(tmp_path / "launch.json")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "opentinker.services.rollout",
            "--launch",
            str(tmp_path / "launch.json"),
        ],
        env={**os.environ, "OPENTINKER_ROLLOUT_LOG_LEVEL": "WARNING"},
    )
    try:
        address = wait_for_file(
            tmp_path / "rollout.addr", timeout_s=60, alive=lambda: process.poll() is None
        )
        assert address.startswith("127.0.0.1:")
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(
                health_pb2.HealthCheckRequest(service="opentinker.rollout.v1.RolloutService"),
                timeout=5,
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
