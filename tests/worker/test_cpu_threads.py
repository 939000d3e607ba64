"""Job processes share the CPU by the jobs the worker runs now (services/common/cpu_share.py)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from google.protobuf import json_format

from opentinker.common.v1 import common_pb2
from opentinker.services.common.cores import cgroup_cpu_quota, usable_cores
from opentinker.services.common.cpu_share import (
    SHARE_FILE_ENV,
    ThreadShareFile,
    ThreadShareReader,
    follow_job_share,
    follow_worker_share,
)
from opentinker.services.common.launch import SMALL_MODEL_BYTES, LaunchConfig, is_small_model
from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.worker import devices
from opentinker.services.worker.devices import Device, cpu_share_of, cpu_thread_env
from opentinker.spec import JobSpec, ModelSpec, RlConfig, SftConfig, to_proto


def cpus(n: int) -> list[Device]:
    return [Device(f"h/cpu:{i}", "cpu") for i in range(n)]


def test_the_cores_are_divided_among_the_jobs_running_now(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(devices, "usable_cores", lambda: 16)
    share = cpu_share_of(cpus(4), tmp_path / "share", reserved=0)
    assert share is not None
    assert [share.threads_for(jobs) for jobs in (0, 1, 2, 4, 32)] == [16, 16, 8, 4, 1]
    # One core left to the services and the jobs' event loops (the default): 15 to divide.
    share = cpu_share_of(cpus(4), tmp_path / "share")
    assert share is not None
    assert [share.threads_for(jobs) for jobs in (1, 2, 4, 32)] == [15, 7, 3, 1]
    # ... and every core for a job whose model is large enough to use them.
    every_core = [share.threads_for(jobs, reserve=False) for jobs in (1, 2, 4, 32)]
    assert every_core == [16, 8, 4, 1]
    assert share.publish(2) == 7 and share.path.read_text() == "7 8\n"
    monkeypatch.setattr(devices, "usable_cores", lambda: 1)  # never below one thread
    share = cpu_share_of(cpus(1), tmp_path / "share")
    assert share is not None and share.threads_for(1) == 1
    monkeypatch.setattr(devices, "usable_cores", lambda: 16)
    share = cpu_share_of(cpus(4), tmp_path / "share", reserved=0)
    assert share is not None
    # Before a process first reads the share it starts with the cores divided among the slots.
    assert cpu_thread_env(cpus(4), share) == {
        "OMP_NUM_THREADS": "4",  # 16 cores / 4 slots
        SHARE_FILE_ENV: str((tmp_path / "share").resolve()),
    }


def test_gpus_and_an_operators_setting_are_left_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    gpu = [Device("h/cuda:0", "cuda")]
    assert cpu_share_of(gpu, tmp_path / "s") is None
    assert cpu_thread_env(gpu, None) == {}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_share_of(cpus(2), tmp_path / "s") is None


def test_the_reader_sees_every_publish_even_two_within_one_clock_tick(tmp_path: Path) -> None:
    share = ThreadShareFile(tmp_path / "share", cores=8)
    reader = ThreadShareReader(share.path)
    assert reader.threads() is None  # nothing published yet: keep what you have
    for jobs, threads in ((1, 8), (2, 4), (4, 2), (1, 8)):  # back to back, microseconds apart
        share.publish(jobs)
        assert reader.threads() == threads
    share.path.write_text("garbage\n")
    assert reader.threads() is None


def test_a_job_takes_the_share_with_or_without_the_reserved_cores(tmp_path: Path) -> None:
    share = ThreadShareFile(tmp_path / "share", cores=8, reserved=2)
    small, large = ThreadShareReader(share.path), ThreadShareReader(share.path, reserve=False)
    for jobs, reserved, every_core in ((1, 6, 8), (2, 3, 4), (16, 1, 1)):
        share.publish(jobs)
        assert (small.threads(), large.threads()) == (reserved, every_core)
    share.path.write_text("3\n")  # a worker that publishes one number: both take it
    assert (small.threads(), large.threads()) == (3, 3)


def test_only_a_small_local_models_job_leaves_the_reserved_cores(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tiny = ensure_tiny_model(tmp_path / "tiny")  # 0.6M parameters, 2.4 MB
    env = {"env_name": "letter"}

    def launch_for(base_model: str) -> LaunchConfig:
        spec = JobSpec(model=ModelSpec(base_model=base_model), rl=RlConfig(**env))
        return launch_of(spec, tmp_path)

    assert launch_for(str(tiny)).leaves_cores_to_services
    large = tmp_path / "large"
    large.mkdir()
    (large / "config.json").write_text("{}")
    with open(large / "model-00001-of-00002.safetensors", "wb") as f:
        f.truncate(SMALL_MODEL_BYTES)  # sparse: the size counts, not the disk it takes
    assert not launch_for(str(large)).leaves_cores_to_services
    (large / "model-00001-of-00002.safetensors").unlink()  # no weight file: not known small
    assert not launch_for(str(large)).leaves_cores_to_services
    assert not launch_for("Qwen/Qwen2.5-1.5B").leaves_cores_to_services  # a hub name
    monkeypatch.chdir(tiny)  # an empty name is no model, not the working directory's files
    assert not is_small_model("")


def test_a_jobs_launch_sets_the_threads_its_processes_compute_with(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What the trainer's and the rollout's first line does (``follow_job_share``): 8 cores,
    1 reserved. A small model's on-policy job takes 7, a large one's 8, and with its rollout
    playing ahead each of its two processes half of that; a process without a launch, 7."""
    share = ThreadShareFile(tmp_path / "share", cores=8, reserved=1)
    share.publish(1)
    monkeypatch.setenv(SHARE_FILE_ENV, str(share.path))
    large = tmp_path / "large"
    large.mkdir()
    with open(large / "model.safetensors", "wb") as f:
        f.truncate(SMALL_MODEL_BYTES)
    tiny = str(ensure_tiny_model(tmp_path / "tiny"))

    def launch(base_model: str, staleness: int) -> LaunchConfig:
        rl = RlConfig(env_name="letter", max_staleness=staleness)
        return launch_of(JobSpec(model=ModelSpec(base_model=base_model), rl=rl), tmp_path)

    async def threads(job: LaunchConfig | None) -> int:
        assert follow_job_share(job)
        return await asyncio.to_thread(torch.get_num_threads)

    before = torch.get_num_threads()
    try:
        assert asyncio.run(threads(launch(tiny, 0))) == 7
        assert asyncio.run(threads(launch(str(large), 0))) == 8
        assert asyncio.run(threads(launch(tiny, 1))) == 3
        assert asyncio.run(threads(launch(str(large), 1))) == 4
        assert asyncio.run(threads(None)) == 7
    finally:
        torch.set_num_threads(before)


def test_compute_threads_follow_the_share_between_tasks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Through asyncio.to_thread, as the trainer and rollout run their compute."""
    share = ThreadShareFile(tmp_path / "share", cores=2)
    monkeypatch.setenv(SHARE_FILE_ENV, str(share.path))
    before = torch.get_num_threads()

    async def main() -> list[int]:
        assert follow_worker_share()
        seen = []
        for jobs in (1, 2, 1):
            share.publish(jobs)
            seen.append(await asyncio.to_thread(torch.get_num_threads))
        return seen

    try:
        assert asyncio.run(main()) == [2, 1, 2]
    finally:
        torch.set_num_threads(before)


def test_without_a_worker_share_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SHARE_FILE_ENV, raising=False)

    async def main() -> bool:
        return follow_worker_share()

    assert not asyncio.run(main())


def launch_of(spec: JobSpec, tmp_path: Path) -> LaunchConfig:
    job = common_pb2.Job(job_id="j", spec=to_proto(spec), attempt=1)
    return LaunchConfig.for_job(
        job, lease_id="l", device_ids=["h/cpu:0"], scheduler_address="s", envhub_address="e",
        run_dir=tmp_path, job_token="t",
    )  # fmt: skip


def test_a_job_whose_rollout_plays_ahead_splits_its_share_between_rollout_and_trainer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With max_staleness >= 1 the rollout generates the next batch while the trainer trains:
    each takes half the job's threads. Strictly on-policy they take turns and each takes all."""
    env = {"env_name": "letter"}
    assert launch_of(JobSpec(rl=RlConfig(**env)), tmp_path).computing_at_once == 2  # default 1
    assert launch_of(JobSpec(rl=RlConfig(**env, max_staleness=3)), tmp_path).computing_at_once == 2
    assert launch_of(JobSpec(rl=RlConfig(**env, max_staleness=0)), tmp_path).computing_at_once == 1
    sft = JobSpec(kind="sft", sft=SftConfig(dataset_path="/data/chat.jsonl"))
    assert launch_of(sft, tmp_path).computing_at_once == 1
    # A spec that fails validation (no env name) is the job start's to report, not a crash here.
    broken = to_proto(JobSpec(rl=RlConfig(**env)))
    broken.rl.env_name = ""
    job = common_pb2.Job(job_id="j", spec=broken, attempt=1)
    launch = launch_of(JobSpec(rl=RlConfig(**env)), tmp_path).model_copy(
        update={"job_json": json_format.MessageToJson(job)}
    )
    assert launch.computing_at_once == 2

    share = ThreadShareFile(tmp_path / "share", cores=8)
    share.publish(1)
    monkeypatch.setenv(SHARE_FILE_ENV, str(share.path))
    before = torch.get_num_threads()

    async def threads(computing_at_once: int) -> int:
        assert follow_worker_share(computing_at_once=computing_at_once)
        return await asyncio.to_thread(torch.get_num_threads)

    try:
        assert asyncio.run(threads(1)) == 8
        assert asyncio.run(threads(2)) == 4
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two trainer ranks split the trainer's half
        assert asyncio.run(threads(2)) == 2
    finally:
        torch.set_num_threads(before)


def test_the_cores_a_job_shares_are_those_a_cgroup_quota_leaves(tmp_path: Path) -> None:
    """The worker divided os.cpu_count() among its jobs: in a container limited to 4 CPUs of a
    64-core host each job took 64 threads, throttled by the quota. The share now starts from
    the CPU affinity capped by the cgroup's quota (v2 cpu.max, v1 cfs quota/period)."""
    affinity = len(os.sched_getaffinity(0))
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("50000 100000\n")  # half a CPU: one core
    assert cgroup_cpu_quota(v2) == 0.5 and usable_cores(v2) == 1
    for garbled in ("100000 0\n", "0 100000\n", "half\n", ""):  # no quota, and no crash
        (v2 / "cpu.max").write_text(garbled)
        assert usable_cores(v2) == affinity, garbled
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(v2) is None and usable_cores(v2) == affinity
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu.cfs_quota_us").write_text("150000\n")
    assert cgroup_cpu_quota(v1.parent) == 1.5 and usable_cores(v1.parent) == min(affinity, 2)
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert usable_cores(v1.parent) == affinity
    assert usable_cores(tmp_path / "none") == affinity
