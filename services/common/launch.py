"""What a worker agent hands to the processes it starts for a job.

The worker writes ``<run_dir>/launch.json`` (this model, as JSON) and starts, at the same time,
``python -m opentinker.services.rollout --launch <run_dir>/launch.json`` and ``python -m
opentinker.services.trainer --launch <run_dir>/launch.json --rollout-address-file
<run_dir>/rollout.addr``; the rollout writes its address to that file once it serves, and the
trainer reads it when it opens the rollout.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from google.protobuf import json_format
from pydantic import BaseModel, ConfigDict, Field

from opentinker.common.v1 import common_pb2
from opentinker.grpc_options import host_port
from opentinker.spec import RlConfig


class LaunchConfig(BaseModel):
    """One attempt of one job on one worker."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_json: str  # common_pb2.Job as JSON (json_format.MessageToJson)
    lease_id: str
    device_ids: list[str]
    scheduler_address: str
    envhub_address: str
    run_dir: Path  # this attempt's folder: launch.json, logs, *.addr
    # The attempt's credential (identity.proto): the trainer and rollout send it on every call
    # and accept only it. The file is written readable by its owner only.
    job_token: str = Field(repr=False)
    # The job's checkpoint folder, the same for every attempt (<checkpoint_root>/<job_id>):
    # the trainer resumes from its last complete checkpoint. None: <run_dir>/checkpoints, seen
    # by this attempt only.
    checkpoint_dir: Path | None = None

    @property
    def job(self) -> common_pb2.Job:
        return json_format.Parse(self.job_json, common_pb2.Job())

    @property
    def computing_at_once(self) -> int:
        """How many of the job's processes compute at the same time: 2 for an RL job whose
        rollout plays the next batch while the trainer trains (max_staleness >= 1), else 1
        (strictly on-policy they take turns; other kinds have one computing process)."""
        spec = self.job.spec
        if spec.kind != common_pb2.JOB_KIND_RL:
            return 1
        # Read off the wire, not through the whole spec's validation: a spec that fails it is
        # reported by the job's own start (run_job), not crashed on here.
        if spec.rl.HasField("max_staleness"):
            staleness = spec.rl.max_staleness
        else:
            staleness = RlConfig.model_fields["max_staleness"].default
        return 2 if staleness >= 1 else 1

    @property
    def leaves_cores_to_services(self) -> bool:
        """Whether the job's compute threads leave a CPU worker's reserved cores to the
        services (cpu_share.py): for a small model only, whose compute is too fine-grained to
        gain from every core and stalls at each OpenMP barrier while another process runs. A
        larger one's compute a second thread nearly halves. On 2 cores, strictly on-policy, the
        reserve took a 0.6M-parameter model's step from 0.051 to 0.048 s and a 2.1M one's from
        0.089 to 0.078 s, but a 16.0M one's from 0.252 to 0.271 s and a 63.5M one's from 0.678
        to 0.897 s (bench/vs_inprocess.py --hidden-size/--layers)."""
        return is_small_model(self.job.spec.model.base_model)

    @classmethod
    def for_job(cls, job: common_pb2.Job, **fields) -> LaunchConfig:
        return cls(job_json=json_format.MessageToJson(job), **fields)

    def write(self, path: Path) -> None:
        write_atomic(path, self.model_dump_json(indent=2), mode=0o600)

    @classmethod
    def read(cls, path: Path) -> LaunchConfig:
        return cls.model_validate_json(Path(path).read_text())


# Weight files below this many bytes make a small model (leaves_cores_to_services): between
# the 2.1M-parameter model the reserve helps (8 MiB in fp32) and the 16.0M one it slows (61 MiB).
SMALL_MODEL_BYTES = 32 * 2**20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def is_small_model(base_model: str) -> bool:
    """A local model folder whose weight files hold under SMALL_MODEL_BYTES; a hub name, a
    folder that cannot be read or one without weight files counts as large."""
    if not base_model:  # Path("") is the working directory
        return False
    folder = Path(base_model)
    try:
        sizes = [f.stat().st_size for f in folder.iterdir() if f.name.endswith(WEIGHT_SUFFIXES)]
    except OSError:
        return False
    return bool(sizes) and sum(sizes) < SMALL_MODEL_BYTES


def write_atomic(path: Path, text: str, *, mode: int = 0o644) -> None:
    """Write text so that a reader never sees a half-written file; ``mode`` from the start."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


def publish_address(address_file: str, host: str, port: int) -> None:
    """Write ``host:port`` to ``address_file`` (none: nothing) once a server serves there: how
    whoever started it on port 0 learns the port (``ServiceProcess.wait_address``)."""
    if address_file:
        write_atomic(Path(address_file), host_port(host, port))


def wait_for_file(path: Path, *, timeout_s: float, alive=lambda: True, poll_s: float = 0.05) -> str:
    """Wait until ``path`` exists and return its text.

    Raises TimeoutError after ``timeout_s``, or RuntimeError as soon as ``alive()`` is false
    (the process that should write it has died).
    """
    deadline = time.monotonic() + timeout_s
    path = Path(path)
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().strip()
        if not alive():
            raise RuntimeError(f"the process that should write {path.name} exited first")
        time.sleep(poll_s)
    raise TimeoutError(f"{path} did not appear within {timeout_s:.0f} s")
