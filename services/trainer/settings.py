"""Trainer process settings (environment variables OPENTINKER_TRAINER_*)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class TrainerSettings(BaseSettings):
    """Deadlines are seconds; every wait on another process has one."""

    model_config = SettingsConfigDict(env_prefix="OPENTINKER_TRAINER_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="TrainerService port; 0 = any free port")
    device: str = Field(
        "",
        description='"cpu", "cuda", "cuda:1"; empty = from the job\'s lease (placement.py: '
        "cuda:0 in bfloat16 for a CUDA lease, cpu in float32 otherwise)",
    )
    log_level: str = "INFO"
    # Largest |logprob difference| on the probe sequence still counted as the same weights.
    # None: the documented tolerance for the trainer/rollout dtype pair
    # (placement.PROBE_TOLERANCE: 1e-3 for float32 on both sides; with bfloat16, 0.2 x the
    # probe's logit std, at least 5e-2).
    probe_tolerance: float | None = Field(None, gt=0)
    sampler_snapshot_memory_mb: float = Field(
        1024.0,
        ge=0,
        description="a session's sampler snapshots (the weights each save_weights_for_sampler "
        "served, kept so its samplers keep sampling them) held in memory; older ones are "
        "written under the checkpoint root and read back when sampled",
    )
    open_timeout_s: float = Field(
        300.0, gt=0, description="rollout loads its model before answering"
    )
    slow_open_notice_s: float = Field(
        10.0,
        ge=0,
        description="an OpenRollout still loading after this long is told to the user (a job "
        "log line), and its time once ready",
    )
    rollout_address_timeout_s: float = Field(
        600.0,
        gt=0,
        description="--rollout-address-file without --rollout-address-timeout (a trainer "
        "started by hand): how long to wait for the rollout, started beside this trainer, to "
        "write its address. The worker passes its own wait (rollout_start_timeout_s) and a grace",
    )
    weight_sync_timeout_s: float = Field(300.0, gt=0)
    weight_transport: Literal["auto", "grpc"] = Field(
        "auto",
        description="how weight updates reach the rollout: auto = offer shared memory (and CUDA "
        "IPC from a GPU) at OpenRollout, used when the rollout can map it (same host and "
        "/dev/shm), gRPC inline bytes otherwise; grpc = always inline",
    )
    collect_timeout_s: float = Field(600.0, gt=0)
    session_usage_report_s: float = Field(
        30.0,
        gt=0,
        description="a training session reports the tokens it sampled and trained since its "
        "last report this often (when there are some), so a trainer that dies loses at most "
        "that much of its usage; its steps and its end report the rest",
    )
    close_timeout_s: float = Field(10.0, gt=0)
    report_timeout_s: float = Field(10.0, gt=0)
    report_retry_s: float = Field(
        120.0,
        ge=0,
        description="keep retrying a progress report this long while the scheduler is "
        "UNAVAILABLE (restarting, or its Redis is); the job fails after that",
    )
    rank_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="a job on N devices: how long a rank waits for the others (joining, and "
        "each collective; followers wait this long for rank 0's next order, which spans a "
        "whole batch's collection), before it fails instead of hanging",
    )
    max_grad_norm: float = Field(1.0, gt=0)
    keep_checkpoints: int = Field(
        2, ge=1, description="complete checkpoints kept per job (the newest); older are deleted"
    )
    on_storage_error: Literal["fail", "requeue"] = Field(
        "fail",
        description="the checkpoint root is full, read-only or forbidden (checked before the "
        "first step, and at every save; the last good checkpoint stays): fail = the job FAILS "
        "with a reason naming the fault, the path and the free space; requeue = the attempt "
        "ends with that reason and the scheduler re-queues the job to resume from its last "
        "checkpoint once the disk is fixed (a lost attempt: after max_attempts it fails)",
    )
