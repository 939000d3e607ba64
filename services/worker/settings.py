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

from opentinker.errors import ConfigError


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerSettings(BaseSettings):
    """One worker agent per machine: which scheduler it serves and what it offers."""

    model_config = SettingsConfigDict(env_prefix="OPENTINKER_", extra="ignore", frozen=True)

    scheduler_address: str = "127.0.0.1:50051"
    envhub_address: str = "127.0.0.1:50052"
    worker_id: str = Field(default_factory=_default_worker_id, min_length=1)
    hostname: str = Field(default_factory=socket.gethostname, min_length=1)
    # Multi-worker jobs whose rank 0 runs here: the address the other workers' ranks reach
    # this host at (MASTER_ADDR; "" = hostname), and the TCP port range (base, count) kept free
    # here for their rendezvous (MASTER_PORT). Env: OPENTINKER_RENDEZVOUS_PORTS='[29500, 64]'.
    rendezvous_host: str = ""
    rendezvous_ports: tuple[int, int] = (29500, 64)
    run_root: Path = Path("runs")
    # Where every attempt of a job finds its checkpoints (<checkpoint_root>/<job_id>): a folder
    # all workers that may run the job can reach (shared storage with more than one node).
    # None: <run_root>/checkpoints.
    checkpoint_root: Path | None = None
    num_cpu_slots: int = Field(1, ge=1, description="CPU slots offered when there is no GPU")
    cpu_cores_reserved: int = Field(
        1,
        ge=0,
        description="(CPU workers) cores the jobs' compute threads leave to the rest: the "
        "services, the jobs' event loops (gRPC, env calls, reports), the envs. Threads that "
        "claim every core stall at each OpenMP barrier whenever one of those runs",
    )
    # Override device detection, e.g. OPENTINKER_DEVICES="cuda:0,cuda:1" or "cpu:0"; each entry
    # becomes "<hostname>/<entry>" and its kind is the part before ":".
    devices: Annotated[list[str], NoDecode] = []
    # argv prefixes of the two processes of a job; "--launch <launch.json>" (and for the trainer
    # "--rollout-address-file <run_dir>/rollout.addr", or "--rollout-address <addr>" of a shared
    # rollout) are appended. Env form: a shell-quoted command line.
    rollout_command: Annotated[list[str], NoDecode] = [
        sys.executable, "-m", "opentinker.services.rollout",
    ]  # fmt: skip
    trainer_command: Annotated[list[str], NoDecode] = [
        sys.executable, "-m", "opentinker.services.trainer",
    ]  # fmt: skip
    rollout_start_timeout_s: float = Field(300.0, gt=0, description="wait for rollout.addr")
    # LoRA RL jobs share one rollout engine per base model on this node, up to this many
    # jobs (adapters) each (shared_rollouts.py); 0 = off: every job has a private rollout.
    shared_lora_capacity: int = Field(0, ge=0, description="adapters per shared rollout")
    shared_lora_max_rank: int = Field(
        64,
        ge=1,
        le=512,
        description="(GPU) the largest LoRA rank a shared vLLM engine admits (it sizes its LoRA "
        "slots by it); a job of a larger rank gets a private rollout",
    )
    stop_grace_s: float = Field(10.0, ge=0, description="SIGTERM -> SIGKILL delay")
    # A hung job process (SIGSTOP, a frozen GPU call) is a lost attempt, not a failed job
    # (job_run.py): these bound how long the worker takes to tell and end it.
    liveness_timeout_s: float = Field(
        5.0,
        gt=0,
        description="a rollout that does not answer a health check within this long when its "
        "trainer failed is hung: killed, and the attempt lost (re-queued), not the job failed",
    )
    peer_lost_grace_s: float = Field(
        5.0,
        ge=0,
        description="how long a trainer whose rollout lost it (exit_codes.PEER_LOST) may take to "
        "exit by itself before it is killed as hung; the attempt is lost either way",
    )
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
    # Warm spares (spares.py): per base model recently launched here (and each of
    # ``warm_models``), this many pre-started rollout + trainer process pairs that have imported
    # torch and loaded the model, each waiting to be handed one job. 0 = off (cold starts).
    warm_spares: int = Field(1, ge=0, description="spare process pairs per warm base model")
    warm_models: Annotated[list[str], NoDecode] = []  # kept warm from start-up, e.g. "Qwen/X"
    warm_models_max: int = Field(2, ge=1, description="most base models kept warm at once")
    # A spare whose job (one device, private rollout, RL or SFT) ended well serves the same
    # tenant's next job of that model instead of exiting (spares.py, reusable.py).
    spare_reuse: bool = True
    spare_idle_s: float = Field(
        600.0, gt=0, description="retire a model's spares when no job asked for it this long"
    )
    # (An agent started as root) each job's processes run as a uid of this range of its own,
    # (first uid, count), one per job at once: they cannot read the agent's worker token, other
    # jobs' folders or other tenants' checkpoints (job_user.py). (0, 0) = off: the agent's uid.
    # Env: OPENTINKER_JOB_UIDS='[20000, 8]'.
    job_uids: tuple[int, int] = (0, 0)
    log_level: str = "INFO"
    # The worker token this agent presents to the scheduler (identity.proto): given directly,
    # or read from a file (e.g. the scheduler's bootstrap worker.token, mode 0600).
    worker_token: str = Field("", repr=False)
    worker_token_file: Path | None = None

    def credential(self) -> str:
        """The worker token; ConfigError naming both settings when neither gives one."""
        if self.worker_token:
            return self.worker_token
        if self.worker_token_file is not None and self.worker_token_file.exists():
            return self.worker_token_file.read_text().strip()
        raise ConfigError(
            "the worker has no worker token: set OPENTINKER_WORKER_TOKEN, or "
            "OPENTINKER_WORKER_TOKEN_FILE to a file holding one (an admin makes one with "
            "`opentinker admin create-worker-token`; the scheduler's bootstrap dir has one)",
            reason="NO_WORKER_TOKEN",
        )

    def checkpoint_dir(self, job_id: str) -> Path:
        """The absolute checkpoint folder of one job, the same for every attempt."""
        root = self.checkpoint_root or self.run_root / "checkpoints"
        return (root / job_id).resolve()

    @field_validator("devices", "warm_models", mode="before")
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

    @field_validator("job_uids")
    @classmethod
    def _uid_range(cls, value: tuple[int, int]) -> tuple[int, int]:
        first, count = value
        if count < 0 or (count and not 1000 <= first <= 2**31 - count):
            raise ValueError(f"(first uid >= 1000, count >= 0), got {value}")
        return value

    @field_validator("rendezvous_ports")
    @classmethod
    def _port_range(cls, value: tuple[int, int]) -> tuple[int, int]:
        base, count = value
        if base < 1 or count < 1 or base + count > 65536:
            raise ValueError(f"(base, count) of TCP ports within 1..65535, got {value}")
        return value
