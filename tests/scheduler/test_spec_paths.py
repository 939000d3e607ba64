"""Every path a job spec can name goes through one check.

The protocol marks each JobSpec field that holds a path on the workers (``worker_path`` in
common.proto). These tests enumerate the spec's fields from its descriptor, so a string field
added later fails here until it is either marked (and so checked) or listed below as not a
path; and every marked field, set to another tenant's checkpoint, is refused by a real
scheduler. The worker's check (where a path really leads: links, ``..``) runs on real folders.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from async_guard import run
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from identity_helpers import api_key

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.common.spec_paths import spec_paths
from opentinker.services.scheduler.server import running_scheduler
from opentinker.services.scheduler.settings import SchedulerSettings
from opentinker.services.worker.job_run import JobRun
from opentinker.services.worker.settings import WorkerSettings
from opentinker.services.worker.spec_paths import refused_path
from opentinker.spec import InferenceConfig, JobSpec, ModelSpec, RlConfig, SftConfig, to_proto

# String fields of JobSpec that are not paths on the workers, each with why.
NOT_PATHS = {
    "name": "the job's display name",
    "model.lora.target_modules": "module names of the model",
    "model.chat_template": "a template name or a Jinja template's text",
    "rl.env_name": "an environment registered with EnvHub",
    "inference.env_name": "an environment registered with EnvHub",
    # Agent programs run the tenant's code on the worker: not a path to read but code to run,
    # refused unless the operator enables them (RolloutSettings.agent_programs).
    "rl.agent.callable": "a Python module:function the rollout imports",
    "rl.agent.command": "a command line the rollout starts",
    "inference.agent.callable": "a Python module:function the rollout imports",
    "inference.agent.command": "a command line the rollout starts",
}
MAPS = {"rl.env_options", "rl.val_env_options", "inference.env_options"}  # read by the env


def _string_fields(message: Descriptor, prefix: str = "") -> Iterator[tuple[str, FieldDescriptor]]:
    for field in message.fields:
        name = f"{prefix}{field.name}"
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                yield name, field
            else:
                yield from _string_fields(field.message_type, f"{name}.")
        elif field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
            yield name, field


def _marked() -> set[str]:
    return {
        name
        for name, field in _string_fields(common_pb2.JobSpec.DESCRIPTOR)
        if field.GetOptions().Extensions[common_pb2.worker_path]
    }


def test_every_string_field_of_a_job_spec_is_a_checked_path_or_said_not_to_be() -> None:
    fields = {name for name, _ in _string_fields(common_pb2.JobSpec.DESCRIPTOR)}
    unclassified = fields - _marked() - set(NOT_PATHS) - MAPS
    assert not unclassified, (
        f"{sorted(unclassified)}: mark each path on the workers [(worker_path) = true] in "
        "common.proto, or list it in NOT_PATHS with why it is not one"
    )
    assert set(NOT_PATHS) | MAPS <= fields, "a listed field no longer exists"
    assert {"model.base_model", "model.init_adapter", "inference.adapter_dir"} <= _marked()
    assert {"sft.dataset_path", "sft.validation_path"} <= _marked()


def test_spec_paths_finds_every_marked_field_at_any_depth() -> None:
    spec = common_pb2.JobSpec(name="job-0123456789ab")  # not a path: never reported
    for name in _marked():
        *parents, leaf = name.split(".")
        holder = spec
        for part in parents:
            holder = getattr(holder, part)
        setattr(holder, leaf, f"/p/{name}")
    assert spec_paths(spec) == {name: f"/p/{name}" for name in _marked()}
    assert spec_paths(common_pb2.JobSpec()) == {}


def _spec_with(field: str, path: str) -> common_pb2.JobSpec:
    """A valid spec of the kind that reads ``field``, with ``path`` in it."""
    lora = ModelSpec(base_model="Qwen/Qwen2.5-1.5B", finetune="lora")
    builders: dict[str, Callable[[], JobSpec]] = {
        "model.base_model": lambda: JobSpec(
            model=ModelSpec(base_model=path), rl=RlConfig(env_name="letter", steps=1)
        ),
        "model.init_adapter": lambda: JobSpec(
            model=lora.model_copy(update={"init_adapter": path}),
            rl=RlConfig(env_name="letter", steps=1),
        ),
        "inference.adapter_dir": lambda: JobSpec(
            kind="inference", inference=InferenceConfig(env_name="letter", adapter_dir=path)
        ),
        "sft.dataset_path": lambda: JobSpec(kind="sft", sft=SftConfig(dataset_path=path)),
        "sft.validation_path": lambda: JobSpec(
            kind="sft", sft=SftConfig(dataset_path="/data/chat.jsonl", validation_path=path)
        ),
    }
    assert set(builders) == _marked(), "a path field without a spec here to try it in"
    spec = to_proto(builders[field]())
    assert spec_paths(spec)[field] == path
    return spec


@pytest.mark.parametrize("field", sorted(_marked()))
def test_every_path_field_naming_another_tenants_job_is_refused(redis_url: str, field: str) -> None:
    """Tenant B named tenant A's checkpoint as its init_adapter (absolute, and relative with
    ``..``) and its job trained from A's weights: the check knew only some fields."""

    async def main() -> None:
        settings = SchedulerSettings(redis_url=redis_url, port=0, heartbeat_interval_s=0.2)
        async with running_scheduler(settings, stop_grace_s=0.2) as running:
            ids = running.stores.identity
            mine = await api_key(ids, tenant="acme", user="erin")
            theirs = await api_key(ids, tenant="globex", user="frank")
            async with (
                aio_channel(running.address, credential=mine) as acme,
                aio_channel(running.address, credential=theirs) as globex,
            ):
                acme_stub = scheduler_pb2_grpc.SchedulerServiceStub(acme)
                globex_stub = scheduler_pb2_grpc.SchedulerServiceStub(globex)

                async def submit(stub, path: str) -> common_pb2.Job:  # noqa: ANN001
                    request = scheduler_pb2.SubmitJobRequest(spec=_spec_with(field, path))
                    return (await stub.SubmitJob(request, timeout=5)).job

                a_job = (await submit(acme_stub, "/srv/own/data.jsonl")).job_id
                absolute = f"/srv/checkpoints/{a_job}/step-000010/data.jsonl"
                relative = f"../../checkpoints/{a_job}/step-000010/data.jsonl"
                assert (await submit(acme_stub, absolute)).job_id  # the owner's tenant may
                assert (await submit(acme_stub, relative)).job_id
                for path in (absolute, relative):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await submit(globex_stub, path)
                    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    details = refused.value.details() or ""
                    assert field in details and "not one of your tenant's jobs" in details

    run(main)


A_JOB, B_JOB = "job-aaaaaaaaaaaa", "job-bbbbbbbbbbbb"


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    """A worker's run root and checkpoint root, with job A's checkpoint and the gateway's
    download secret in it."""
    run_root, checkpoints = tmp_path / "runs", tmp_path / "checkpoints"
    (checkpoints / A_JOB / "step-000010").mkdir(parents=True)
    (checkpoints / ".gateway-download-secret").write_text("s3cret")
    (run_root / B_JOB / "attempt-1").mkdir(parents=True)
    return run_root, checkpoints


def _refused(path: str, roots: tuple[Path, Path]) -> str | None:
    run_root, checkpoints = roots
    spec = common_pb2.JobSpec(model=common_pb2.ModelSpec(init_adapter=path))
    cwd = run_root / B_JOB / "attempt-1"
    return refused_path(spec, job_id=B_JOB, cwd=cwd, roots=[run_root, checkpoints])


def test_the_worker_refuses_a_link_into_another_jobs_folder(roots: tuple[Path, Path]) -> None:
    run_root, checkpoints = roots
    link = run_root / B_JOB / "innocent"
    os.symlink(checkpoints / A_JOB / "step-000010", link)
    why = _refused(str(link), roots)
    assert why is not None and why.startswith("model.init_adapter: ")
    assert A_JOB in why and "not into the folder of this job" in why
    assert _refused("../innocent", roots) is not None  # relative to the attempt's folder
    assert _refused(str(checkpoints / ".gateway-download-secret"), roots) is not None


def test_the_worker_lets_through_named_jobs_own_folders_and_outside_paths(
    roots: tuple[Path, Path],
) -> None:
    _, checkpoints = roots
    assert _refused(str(checkpoints / A_JOB / "step-000010"), roots) is None  # named: the
    # scheduler made sure it is the tenant's
    assert _refused("Qwen/Qwen2.5-1.5B", roots) is None  # a hub id: under the job's own folder
    assert _refused("/srv/models/smollm2", roots) is None  # the operator's, outside


def test_a_refused_path_ends_the_attempt_before_any_process_starts(
    roots: tuple[Path, Path],
) -> None:
    run_root, checkpoints = roots
    link = run_root / B_JOB / "innocent"
    os.symlink(checkpoints / A_JOB, link)
    marker = run_root / "started"

    async def launched() -> None:
        raise AssertionError("a process was launched")

    spec = to_proto(JobSpec(rl=RlConfig(env_name="letter", steps=1)))
    spec.model.base_model = str(link)
    job_run = JobRun(
        common_pb2.Job(job_id=B_JOB, attempt=1, spec=spec),
        lease_id="lease-b",
        device_ids=["h/cpu:0"],
        job_token="",
        settings=WorkerSettings(
            run_root=run_root,
            checkpoint_root=checkpoints,
            worker_id="w",
            devices=["cpu:0"],
            trainer_command=["touch", str(marker)],
            rollout_command=["touch", str(marker)],
        ),
        on_launched=launched,
    )
    ended = asyncio.run(job_run.run())
    assert ended.exit_code == 1 and ended.reason.startswith("model.base_model: ")
    assert not marker.exists()


_CHECK_UNREADABLE = """
import sys
from pathlib import Path
from opentinker.common.v1 import common_pb2
from opentinker.services.worker.spec_paths import refused_path
spec = common_pb2.JobSpec(model=common_pb2.ModelSpec(base_model=sys.argv[1]))
print(refused_path(spec, job_id="job-bbbbbbbbbbbb", cwd=Path("/"), roots=[]))
"""


def test_a_model_file_the_workers_user_cannot_read_is_named(tmp_path: Path) -> None:
    """A model file of mode 0600 and another owner failed the job later with safetensors'
    "No such file or directory", naming neither the file nor the cause."""
    import shutil
    import subprocess
    import sys

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = model / "model.safetensors"
    weights.write_bytes(b"\0" * 16)
    weights.chmod(0o600)
    command = [sys.executable, "-c", _CHECK_UNREADABLE, str(model)]
    if os.geteuid() == 0:  # root reads anything: drop the capabilities that let it
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: cannot drop the read override")
        os.chown(weights, 12345, 12345)  # another owner
        caps = "-dac_override,-dac_read_search"
        command = ["setpriv", "--bounding-set", caps, "--inh-caps", caps, *command]
    else:
        weights.chmod(0o000)
    said = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert said.returncode == 0, said.stderr[-2000:]
    line = said.stdout.strip().splitlines()[-1]
    assert line.startswith(f"model.base_model: {str(model)!r}: {weights} cannot be read"), line
    assert "mode 600" in line or "mode 0" in line
    assert (
        refused_path(  # readable as the owner: let through
            common_pb2.JobSpec(model=common_pb2.ModelSpec(base_model=str(model / "config.json"))),
            job_id="job-bbbbbbbbbbbb",
            cwd=Path("/"),
            roots=[],
        )
        is None
    )
