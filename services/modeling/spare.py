"""Warm spares: a trainer or rollout process started before its job, waiting to be handed one.

The worker starts ``python -m opentinker.services.<trainer|rollout> --spare [--preload-model M]``
with a pipe on stdin. The process imports torch/transformers/peft, loads ``M`` (see
``modeling/preload.py``), then blocks on one line of stdin: a ``Handover`` (JSON) naming the
job's launch file. Nothing job-specific (token, spec, devices, seed) reaches the process before
that line; it then serves that one job exactly as a freshly started process would and exits.
A spare whose stdin closes without a hand-over (the worker retired it, or died) exits 0.

A hand-over marked ``reusable`` (the worker's ``spare_reuse``: one device, a private rollout,
RL or SFT) keeps the process after a job that ended well: ``serve_jobs`` reports the end on
the pipe the worker gave it (``REPORT_FD_ENV``), puts its log and folder back, loads the base
model again from its files (no trained weights of the job stay) and waits for the next hand-over,
which the worker gives it only for a job of the same tenant and base model. The imports,
the interpreter and the start of a process are then paid once for many short jobs. A LoRA
job's wrapped base is kept instead of read again (its base weights are never trained; the next
job makes its adapter anew from its own seed: modeling/kept_wrap.py).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TextIO

import structlog
from pydantic import BaseModel, ConfigDict

from opentinker.services.common.heap import freeze_imports_once
from opentinker.services.common.logging import configure_logging

if TYPE_CHECKING:
    from opentinker.services.modeling.preload import Preload

log = structlog.get_logger(__name__)

# A spare exits with this when its stdin closed before a job was handed over.
RETIRED_EXIT_CODE = 0
# The write end of a pipe to the worker, where a reusable spare reports each job's end
# ({"ended": exit code}, one JSON line).
REPORT_FD_ENV = "OPENTINKER_SPARE_REPORT_FD"



class Handover(BaseModel):
    """What the worker writes to a spare's stdin to give it a job (one JSON line)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    launch: Path  # <run_dir>/launch.json (mode 0600: it holds the job token)
    log_path: Path  # where the process writes from now on: <run_dir>/<trainer|rollout>.log
    cuda_visible_devices: str  # the leased GPUs ("" on CPU), set before CUDA is first used
    rollout_address: str = ""  # the trainer's --rollout-address
    # or the trainer's --rollout-address-file: its private rollout, starting beside it, writes
    # its address there (trainer/rollout_link/rollout_address.py)
    rollout_address_file: Path | None = None
    rollout_address_timeout_s: float | None = None  # and how long to wait for it
    # After a job that ended well, report its end and wait for the next (serve_jobs).
    reusable: bool = False

    def line(self) -> bytes:
        return (self.model_dump_json() + "\n").encode()


def wait_for_handover(stdin: TextIO = sys.stdin) -> Handover | None:
    """Block until the worker hands a job over; None when stdin closes first (retired)."""
    line = stdin.readline()
    if not line.strip():
        return None
    return Handover.model_validate_json(line)


def adopt(handover: Handover, *, waited_s: float) -> None:
    """Become the job's process: its devices, its log file, its run folder."""
    torch = sys.modules.get("torch")
    same_devices = os.environ.get("CUDA_VISIBLE_DEVICES") == handover.cuda_visible_devices
    if torch is not None and torch.cuda.is_initialized() and not same_devices:
        # the devices cannot be changed now (a reused process keeps its job's devices)
        raise RuntimeError("this spare initialised CUDA before its hand-over; it cannot be used")
    os.environ["CUDA_VISIBLE_DEVICES"] = handover.cuda_visible_devices
    sys.stdout.flush()
    sys.stderr.flush()
    handover.log_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(handover.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)  # sys.stdout/sys.stderr (and structlog's printer) now write to the job's log
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(handover.launch.parent)
    # The first line of the job's log says how it started (tests and people look for it).
    log.info("warm_start", pid=os.getpid(), spare_waited_s=round(waited_s, 3))


def become_job_process(
    service: str, preload_model: str | None, kept: Preload | None = None
) -> tuple[Preload, Handover]:
    """Spare mode, start to end: preload (or ``kept``: what the last job left, common to the
    next), wait, adopt; returns (preload, handover). A spare retired without a job exits here
    (``RETIRED_EXIT_CODE``)."""
    from opentinker.services.modeling import preload as preloading  # noqa: PLC0415 - torch

    configure_logging(service)  # again by the service's main after hand-over, with its level
    preload = kept or preloading.Preload.of(preload_model)
    log.info("spare_ready", pid=os.getpid(), model=preload_model or "-")
    ready = time.monotonic()
    handover = wait_for_handover()
    if handover is None:
        log.info("spare_retired", pid=os.getpid())
        sys.exit(RETIRED_EXIT_CODE)
    adopt(handover, waited_s=time.monotonic() - ready)
    return preload, handover


class _Home:
    """A spare's own log (its stdout and stderr) and folder, kept while it serves a job."""

    def __init__(self) -> None:
        sys.stdout.flush()
        self.out = os.dup(1)
        self.cwd = os.getcwd()

    def restore(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.out, 1)
        os.dup2(self.out, 2)
        os.chdir(self.cwd)


def serve_jobs(
    service: str, preload_model: str | None, run_one: Callable[[Preload, Handover], int]
) -> NoReturn:
    """Spare mode for a process that may serve several jobs in turn: ``run_one`` runs each
    and returns its exit code. It exits with that code unless the job was handed over
    ``reusable``, ended with 0 and the worker gave a report pipe; then it reports the end and
    becomes a spare again (a fresh load of the base model, its own log and folder)."""
    home = _Home()
    report = os.environ.get(REPORT_FD_ENV)
    if report:
        from opentinker.services.modeling import preload as _  # noqa: F401, PLC0415 - torch

        freeze_imports_once()  # no job's objects frozen: each job's are freed at its end
    kept: Preload | None = None
    while True:
        preload, handover = become_job_process(service, preload_model, kept)
        code = run_one(preload, handover)
        if not (handover.reusable and code == 0 and report):
            sys.exit(code)
        # A LoRA job's wrapped model is kept, its adapter made anew by the next job
        # (kept_wrap.py); anything else the job trained is dropped and the base read again.
        kept = preload if preload.take_back() else None
        del preload  # the job's policy and optimizer: nothing of them reaches the next job
        home.restore()
        # The job has ended: said at once, so its end waits for nothing below (a hand-over
        # meanwhile waits on stdin until the process is ready again).
        os.write(int(report), (json.dumps({"ended": code}) + "\n").encode())
        log.info("job_ended_spare_again", pid=os.getpid(), code=code)
        gc.collect()  # the job's cycles (its model, optimizer): only its objects are walked
