"""Scheduler settings, read from OPENTINKER_* environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class SchedulerSettings(BaseSettings):
    """Where the scheduler listens, where its state lives, and how fast workers must heartbeat."""

    model_config = SettingsConfigDict(env_prefix="OPENTINKER_", extra="ignore", frozen=True)

    redis_url: str = Field(..., min_length=1, description="e.g. redis://127.0.0.1:6379/0")
    host: str = "127.0.0.1"
    port: int = Field(50051, ge=0, le=65535, description="0 = any free port")
    address_file: str = Field(
        "",
        description="once serving, write host:port here (a launcher that starts it on port 0 "
        "learns the port it got; nothing is picked in advance for another process to take)",
    )
    heartbeat_interval_s: float = Field(2.0, gt=0, description="seconds between heartbeats")
    lease_ttl_s: float = Field(
        10.0, gt=0, description="seconds a lease outlives its worker's last heartbeat"
    )
    max_attempts: int = Field(
        3, ge=1, description="attempts of a job before a lost one fails it instead of re-queuing"
    )
    unschedulable_after_s: float = Field(
        300.0,
        gt=0,
        description="a job needing more devices than any connected worker has fails after this",
    )
    reconnect_grace_s: float = Field(
        20.0,
        ge=0,
        description="after a start or a Redis outage, seconds absent workers have to reconnect "
        "and re-announce their running jobs before their lapsed leases are re-queued",
    )
    instance_check_interval_s: float = Field(
        1.0,
        gt=0,
        description="how often the scheduler checks that Redis still holds its state (its "
        "marker, lost_state.py); a Redis emptied under it is refused within about this long",
    )
    drain_timeout_s: float = Field(
        60.0,
        gt=0,
        description="an attempt the scheduler stopped (cancelled, re-queued) keeps its devices "
        "until its worker reports its processes exited, or this many seconds at most (a worker "
        "that never reports); more than the worker's stop grace (SIGTERM to SIGKILL, trainer "
        "and rollout in turn)",
    )
    event_max_progress: int = Field(
        10_000,
        ge=1,
        description="newest step/log events kept per job; older ones are trimmed (state "
        "changes are always kept)",
    )
    shared_lora_sessions: int = Field(
        0,
        ge=0,
        description="LoRA sessions of one base model that one shared trainer process (a host "
        "on one device) serves, each holding 1/this of the device (shared_hosts.py); 0 = every "
        "session a device and a trainer of its own",
    )
    log_level: str = "INFO"
    # The HMAC key under which credentials are stored; made (mode 0600) if the file is missing.
    # Unset: a secret kept in Redis beside the digests (fine for one machine; set a file, kept
    # apart from Redis's data, in deployment).
    auth_secret_file: Path | None = None
    # Where the first admin key and worker token are written (mode 0600); unset = not made.
    bootstrap_dir: Path | None = None
    # Where that worker token goes instead, apart from the admin key and the auth secret (the
    # folder a worker mounts); unset = bootstrap_dir.
    worker_token_dir: Path | None = None

    @model_validator(mode="after")
    def _ttl_outlasts_heartbeats(self) -> SchedulerSettings:
        if self.lease_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"lease_ttl_s ({self.lease_ttl_s}) must be greater than heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), or leases lapse between heartbeats; "
                "set OPENTINKER_LEASE_TTL_S to a few heartbeat intervals"
            )
        return self
