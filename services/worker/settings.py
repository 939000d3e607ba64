"""Worker agent settings, read from OPENTINKER_* environment variables."""

from __future__ import annotations

import os
import shlex
import socket
import sys
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerSettings(BaseSettings):
    """One worker agent per machine: which scheduler it serves and what it offers."""

    model_config = SettingsConfigDict(env_prefix="OPENTINKER_", extra="ignore", frozen=True)

    scheduler_address: str = "127.0.0.1:50051"
    envhub_address: str = "127.0.0.1:50052"
    worker_id: str = Field(default_factory=_default_worker_id, min_length=1)
    hostname: str = Field(default_factory=socket.gethostname, min_length=1)
    run_root: Path = Path("runs")
    num_cpu_slots: int = Field(1, ge=1, description="CPU slots offered when there is no GPU")
    # Override device detection, e.g. OPENTINKER_DEVICES="cuda:0,cuda:1" or "cpu:0"; each entry
    # becomes "<hostname>/<entry>" and its kind is the part before ":".
    devices: Annotated[list[str], NoDecode] = []
    # argv prefixes of the two processes of a job; "--launch <launch.json>" (and for the trainer
    # "--rollout-address <addr>") are appended. Env form: a shell-quoted command line.
    rollout_command: Annotated[list[str], NoDecode] = [
        sys.executable, "-m", "opentinker.services.rollout",
    ]  # fmt: skip
    trainer_command: Annotated[list[str], NoDecode] = [
        sys.executable, "-m", "opentinker.services.trainer",
    ]  # fmt: skip
    rollout_start_timeout_s: float = Field(300.0, gt=0, description="wait for rollout.addr")
    stop_grace_s: float = Field(10.0, ge=0, description="SIGTERM -> SIGKILL delay")
    connect_timeout_s: float = Field(10.0, gt=0, description="wait for the scheduler's answer")
    reconnect_initial_s: float = Field(0.5, gt=0)
    reconnect_max_s: float = Field(10.0, gt=0)
    orphan_grace_s: float = Field(
        30.0,
        gt=0,
        description="keep jobs running this long without a scheduler (a restart, a dropped "
        "stream); after that they are stopped, since the scheduler has re-queued them (a few "
        "lease TTLs)",
    )
    log_level: str = "INFO"

    @field_validator("devices", mode="before")
    @classmethod
    def _split_devices(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("rollout_command", "trainer_command", mode="before")
    @classmethod
    def _split_command(cls, value: object) -> object:
        return shlex.split(value) if isinstance(value, str) else value

    @field_validator("rollout_command", "trainer_command")
    @classmethod
    def _non_empty(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("needs at least the program to run")
        return value
