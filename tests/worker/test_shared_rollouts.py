"""Placement on a node: LoRA RL jobs of one base model join one shared rollout process (real,
``python -m opentinker.services.rollout --shared-base``) while it has room; a full fine-tuning
job keeps a private rollout; the shared process ends with its last job.

JobRun is the worker's real one; the trainer is a stand-in script that records the rollout
address it was given and waits for the test to let it finish (the real trainer against a
shared rollout is tests/e2e/test_multi_lora_learn.py).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from identity_service import Identities

from opentinker.common.v1 import common_pb2
from opentinker.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.worker.job_run import JobRun
from opentinker.services.worker.settings import WorkerSettings
from opentinker.services.worker.shared_rollouts import (
    SharedRollouts,
    lease_kind,
    shares_engine,
)
from opentinker.spec import JobSpec, ModelSpec, RlConfig, SftConfig, to_proto

pytestmark = pytest.mark.integration

STAND_IN_TRAINER = """
import sys, time
from pathlib import Path
from opentinker.services.common.launch import LaunchConfig
config = LaunchConfig.read(Path(sys.argv[sys.argv.index("--launch") + 1]))
if "--rollout-address" in sys.argv:  # the shared rollout: its address is known
    address = sys.argv[sys.argv.index("--rollout-address") + 1]
else:  # a private rollout, started beside this trainer, writes its address there
    address_file = Path(sys.argv[sys.argv.index("--rollout-address-file") + 1])
    while not address_file.exists():
        time.sleep(0.05)
    address = address_file.read_text().strip()
(config.run_dir / "trainer.rollout").write_text(address)
while not (config.run_dir / "finish").exists():
    time.sleep(0.05)
"""


def job(job_id: str, model_dir: Path, finetune: str = "lora") -> common_pb2.Job:
    spec = JobSpec(
        name=job_id,
        model=ModelSpec(base_model=str(model_dir), finetune=finetune),  # type: ignore[arg-type]
        rl=RlConfig(env_name="letter", steps=1),
    )
    return common_pb2.Job(job_id=job_id, attempt=1, spec=to_proto(spec))


@pytest.mark.unit
def test_only_lora_rl_on_one_kind_of_device_shares_an_engine(tmp_path: Path) -> None:
    lora = job("j", tmp_path)
    assert shares_engine(lora, ["node/cpu:0"])
    assert shares_engine(lora, ["node/cuda:0", "node/cuda:1"])  # GPU: vLLM's multi-LoRA
    assert not shares_engine(lora, ["node/cuda:0", "node/cpu:0"])
    assert (lease_kind(["n/cuda:3"]), lease_kind(["n/cpu:0", "n/cpu:1"])) == ("cuda", "cpu")
    assert lease_kind([]) is None and lease_kind(["n/tpu:0"]) is None
    assert not shares_engine(job("j", tmp_path, finetune="full"), ["node/cpu:0"])
    sft = JobSpec(
        name="s", kind="sft", model=ModelSpec(base_model="m"), sft=SftConfig(dataset_path="d.jsonl")
    )
    assert not shares_engine(common_pb2.Job(job_id="s", spec=to_proto(sft)), ["node/cpu:0"])


@pytest.mark.unit
def test_a_gpu_job_of_a_larger_rank_than_the_engine_slots_keeps_a_private_rollout(
    tmp_path: Path,
) -> None:
    settings = WorkerSettings(
        scheduler_address="127.0.0.1:1",
        run_root=tmp_path,
        shared_lora_capacity=2,
        shared_lora_max_rank=32,
        rollout_command=["false"],  # nothing may be started for it
    )
    shared = SharedRollouts(settings, {})
    joined = asyncio.run(shared.join("j", "m", device_ids=["node/cuda:0"], rank=64))
    assert joined is None and shared.serving("m") == []
    assert not (tmp_path / "shared-rollouts").exists()


def test_lora_jobs_of_one_base_share_a_rollout_until_it_is_full(
    identities: Identities, tmp_path: Path
) -> None:
    model_dir = build_tiny_model(tmp_path / "tiny")
    trainer_script = tmp_path / "stand_in_trainer.py"
    trainer_script.write_text(STAND_IN_TRAINER)
    settings = WorkerSettings(
        scheduler_address=identities.scheduler_address,
        envhub_address="127.0.0.1:1",  # no episode is played here
        run_root=tmp_path / "runs",
        trainer_command=[sys.executable, str(trainer_script)],
        shared_lora_capacity=2,
        warm_spares=0,
        stop_grace_s=2.0,
    )

    async def scenario() -> None:
        shared = SharedRollouts(settings, {"PYTHONUNBUFFERED": "1", "PATH": "/usr/bin:/bin"})
        jobs = {
            "job-1": job("job-1", model_dir),
            "job-9": job("job-9", model_dir),
            "job-r": job("job-r", model_dir),  # a third LoRA job: the engine is full
            "job-proc": job("job-proc", model_dir, finetune="full"),
        }

        async def launched() -> None:
            return None

        runs = {
            job_id: JobRun(
                j,
                lease_id=f"lease-{job_id}",
                device_ids=["node/cpu:0"],
                job_token=identities.job_token(job_id),
                settings=settings,
                on_launched=launched,
                shared=shared,
            )
            for job_id, j in jobs.items()
        }
        tasks = {}
        for job_id, run in runs.items():  # one after the other: the order decides who shares
            tasks[job_id] = asyncio.create_task(run.run())
            await _wait_for(run.run_dir / "trainer.rollout")
            if job_id == "job-1":  # the engine runs on CPU: a GPU lease does not join it
                gpu_job = await shared.join("job-g", str(model_dir), device_ids=["node/cuda:0"])
                assert gpu_job is None and shared.serving(str(model_dir)) == ["job-1"]
        given = {job_id: (r.run_dir / "trainer.rollout").read_text() for job_id, r in runs.items()}
        assert given["job-1"] == given["job-9"]  # one shared rollout for both
        assert len({given["job-1"], given["job-r"], given["job-proc"]}) == 3  # private ones
        assert shared.serving(str(model_dir)) == ["job-1", "job-9"]
        assert not (runs["job-1"].run_dir / "rollout.pid").exists()  # no rollout of its own
        assert (runs["job-r"].run_dir / "rollout.pid").exists()

        # it is the real shared engine: job-1's token opens its own job there
        async with aio_channel(given["job-1"], credential=identities.job_token("job-1")) as c:
            call = rollout_pb2_grpc.RolloutServiceStub(c).Rollout()
            model = common_pb2.ModelSpec(
                base_model=str(model_dir), finetune=common_pb2.FINETUNE_MODE_LORA
            )
            await call.write(
                rollout_pb2.RolloutRequest(
                    seq=1,
                    open=rollout_pb2.OpenRollout(job_id="job-1", model=model, sampling_only=True),
                )
            )
            reply = await asyncio.wait_for(call.read(), 60)
            assert reply.opened.engine == "transformers-multi-lora", reply
            call.cancel()

        engine_process = shared._engines[str(model_dir)].process  # noqa: SLF001 - a probe
        for job_id in ("job-1", "job-r", "job-proc"):
            (runs[job_id].run_dir / "finish").write_text("")
            assert (await tasks[job_id]).exit_code == 0
        assert engine_process.running  # job-9 still uses it
        assert shared.serving(str(model_dir)) == ["job-9"]
        (runs["job-9"].run_dir / "finish").write_text("")
        assert (await tasks["job-9"]).exit_code == 0
        assert not engine_process.running  # the last job out stopped it
        assert shared.serving(str(model_dir)) == []
        await shared.close()

    asyncio.run(scenario())


async def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not path.exists():
        assert loop.time() < deadline, f"{path} did not appear in {timeout_s:.0f} s"
        await asyncio.sleep(0.05)
