"""The scheduler offers a LoRA RL job first to a worker already running LoRA jobs of its base
model (where the node's shared rollout can take it); other jobs keep the workers' order.
Real Redis, a real scheduler over gRPC, two scripted ConnectWorker clients."""

from __future__ import annotations

import pytest
from async_guard import run
from scheduler_helpers import RPC_TIMEOUT_S, ScriptedWorker, scheduler_mesh

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.spec import JobSpec, ModelSpec, RlConfig, to_proto

pytestmark = pytest.mark.integration


async def submit(stub, name: str, base_model: str, finetune: str = "lora") -> common_pb2.Job:
    spec = JobSpec(
        name=name,
        model=ModelSpec(base_model=base_model, finetune=finetune),  # type: ignore[arg-type]
        rl=RlConfig(env_name="letter", steps=3),
    )
    request = scheduler_pb2.SubmitJobRequest(spec=to_proto(spec))
    return (await stub.SubmitJob(request, timeout=RPC_TIMEOUT_S)).job


async def launched_on(worker: ScriptedWorker) -> common_pb2.Job:
    launch = (await worker.next_command()).launch
    await worker.send(
        launched=scheduler_pb2.JobLaunched(job_id=launch.job.job_id, attempt=launch.job.attempt)
    )
    return launch.job


def test_lora_jobs_of_one_base_go_where_that_base_runs(redis_url: str) -> None:
    async def main() -> None:
        async with scheduler_mesh(redis_url) as mesh:
            a = ScriptedWorker(mesh.worker_stub, "wa", ["wa/cpu:0"])
            b = ScriptedWorker(mesh.worker_stub, "wb", ["wb/cpu:0", "wb/cpu:1", "wb/cpu:2"])
            await a.connect()  # first in the workers' order
            await b.connect()
            full = await submit(mesh.stub, "full", "model-x", finetune="full")
            assert (await launched_on(a)).job_id == full.job_id  # a is first and free
            first = await submit(mesh.stub, "lora-1", "model-x")
            assert (await launched_on(b)).job_id == first.job_id  # a is full
            await a.send(exited=scheduler_pb2.JobExited(job_id=full.job_id, attempt=1, exit_code=0))
            # a is free again and first in order, but b runs a LoRA job of model-x
            second = await submit(mesh.stub, "lora-2", "model-x")
            assert (await launched_on(b)).job_id == second.job_id
            # another base model, or full fine-tuning, takes the workers' order: a
            other = await submit(mesh.stub, "lora-y", "model-y")
            assert (await launched_on(a)).job_id == other.job_id
            await a.disconnect()
            await b.disconnect()

    run(main)
