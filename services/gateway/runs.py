"""Training runs and their checkpoints, as Tinker's RestClient lists and deletes them.

A training run is one of the caller's gateway session jobs (the mesh's record: the scheduler's
job list); its training checkpoints are the states its trainer saved, read from the workers'
shared checkpoint root (``<root>/<job id>/states/<name>/session.json`` names the owner
tenant). Sampler checkpoints are the names given to save_weights_for_sampler: states too
(``sampler.<name>``), so they stay sampleable after the run has ended.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

from opentinker.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from opentinker.jobs import JobInfo
from opentinker.services.gateway.models import (
    EXTERNAL_KIND,
    EXTERNAL_PREFIX,
    SAMPLER_KIND,
    SAMPLER_PREFIX,
    STATE_KIND,
    TinkerPath,
)
from opentinker.services.gateway.state import Gateway
from opentinker.services.gateway.tenancy import Caller

SESSION_FILE = "session.json"  # what the trainer writes beside a saved state (state.py)
RUN_FILE = "tinker_run.json"  # {"user_metadata": {...}}: what create_model was given
TTL_FILE = "tinker_ttl.json"  # {"expires_at": unix s}: the gateway deletes the state after it
RUN_NAME = "tinker"  # the name of the session jobs the gateway starts


async def list_training_runs(gw: Gateway, caller: Caller, body: dict) -> dict:
    limit, offset = _count(body, "limit", 20), _count(body, "offset", 0)
    jobs = await asyncio.to_thread(_runs, caller)
    page = jobs[offset : offset + limit]
    runs = [await asyncio.to_thread(_training_run, gw, caller, job) for job in page]
    cursor = {"offset": offset, "limit": limit, "total_count": len(jobs)}
    return {"training_runs": runs, "cursor": cursor}


async def get_training_run(gw: Gateway, caller: Caller, body: dict) -> dict:
    job = await asyncio.to_thread(_run, caller, body["training_run_id"])
    return await asyncio.to_thread(_training_run, gw, caller, job)


async def list_checkpoints(gw: Gateway, caller: Caller, body: dict) -> dict:
    job = await asyncio.to_thread(_run, caller, body["training_run_id"])
    return {"checkpoints": _checkpoints(gw, caller, job)}


async def list_user_checkpoints(gw: Gateway, caller: Caller, body: dict) -> dict:
    limit, offset = _count(body, "limit", 100), _count(body, "offset", 0)
    jobs = await asyncio.to_thread(_runs, caller)
    every = [c for job in jobs for c in _checkpoints(gw, caller, job)]
    every.sort(key=lambda c: c["time"], reverse=True)
    cursor = {"offset": offset, "limit": limit, "total_count": len(every)}
    return {"checkpoints": every[offset : offset + limit], "cursor": cursor}


async def set_checkpoint_ttl(gw: Gateway, caller: Caller, body: dict) -> None:
    """PUT .../ttl {"ttl_seconds": n | null}: the checkpoint is deleted n seconds from now
    (null: kept)."""
    path = TinkerPath.parse(f"tinker://{body['training_run_id']}/{body['checkpoint_id']}")
    await asyncio.to_thread(_run, caller, path.job_id)
    await asyncio.to_thread(set_ttl, gw, caller, path, body.get("ttl_seconds"))


def set_ttl(gw: Gateway, caller: Caller, path: TinkerPath, ttl_seconds: float | None) -> None:
    if path.kind == SAMPLER_KIND:
        return  # served weights end with their run
    ttl_file = saved_state(gw, caller, path) / TTL_FILE
    if ttl_seconds is None:
        ttl_file.unlink(missing_ok=True)
    elif float(ttl_seconds) < 0:
        raise InvalidArgumentError(f"ttl_seconds: {ttl_seconds} is negative")
    else:
        ttl_file.write_text(json.dumps({"expires_at": time.time() + float(ttl_seconds)}))


def delete_expired(root: Path) -> list[Path]:
    """Delete the saved states whose TTL has passed; the folders deleted."""
    now, gone = time.time(), []
    for ttl_file in root.glob(f"*/states/*/{TTL_FILE}"):
        try:
            expires_at = float(json.loads(ttl_file.read_text())["expires_at"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if expires_at <= now:
            shutil.rmtree(ttl_file.parent, ignore_errors=True)
            gone.append(ttl_file.parent)
    return gone


async def delete_checkpoint(gw: Gateway, caller: Caller, body: dict) -> None:
    """Delete a training, sampler or external-weights checkpoint (its state folder) of one
    of the caller's runs (samplers made from it before keep sampling it)."""
    run, checkpoint = body["training_run_id"], body["checkpoint_id"]
    path = TinkerPath.parse(f"tinker://{run}/{checkpoint}")
    await asyncio.to_thread(_run, caller, run)
    await asyncio.to_thread(shutil.rmtree, saved_state(gw, caller, path))


def check_saved_state(gw: Gateway, caller: Caller, path: TinkerPath) -> None:
    """NotFoundError now for a state that is not there (when the gateway sees the checkpoint
    root), rather than after a training session was started to load it."""
    if gw.settings.checkpoint_root is not None:
        saved_state(gw, caller, path)


def saved_state(gw: Gateway, caller: Caller, path: TinkerPath) -> Path:
    folder = _states(gw, path.job_id) / path.trainer_name
    if not _owned(folder, caller):
        raise NotFoundError(f"path: no saved session state of yours at {str(path)!r}")
    return folder


def _runs(caller: Caller) -> list[JobInfo]:
    return [j for j in caller.client.list_jobs() if j.kind == "SESSION" and j.name == RUN_NAME]


def _run(caller: Caller, run_id: str) -> JobInfo:
    """One of the caller's runs (the scheduler answers NOT_FOUND for others' jobs)."""
    job = caller.client.get_job(run_id)
    if job.kind != "SESSION" or job.name != RUN_NAME:
        raise NotFoundError(f"training_run_id: no training run {run_id!r} of yours")
    return job


def _training_run(gw: Gateway, caller: Caller, job: JobInfo) -> dict:
    model = gw.job_model(caller, job.job_id)
    live = gw.models.live_job(job.job_id)
    checkpoints = _checkpoints(gw, caller, job)
    last = {
        kind: next((c for c in checkpoints if c["checkpoint_type"] == kind), None)
        for kind in ("training", "sampler")
    }
    return {
        "training_run_id": job.job_id,
        "base_model": live.base_model if live else model.base_model,
        "model_owner": job.tenant_id or caller.tenant_id,
        "is_lora": True,
        "corrupted": job.state == "FAILED",
        "lora_rank": model.lora.rank,
        "last_request_time": _iso(job.updated_unix_s),
        "last_checkpoint": last["training"],
        "last_sampler_checkpoint": last["sampler"],
        "user_metadata": {**_user_metadata(gw, job.job_id), "state": job.state},
    }


def keep_user_metadata(gw: Gateway, job_id: str, metadata: dict) -> None:
    """Keep a run's user_metadata (values as text, as Tinker returns them) beside its
    checkpoints, where the run's listing reads it; nowhere without a checkpoint root."""
    if gw.settings.checkpoint_root is None:
        return
    folder = Path(gw.settings.checkpoint_root) / job_id
    folder.mkdir(parents=True, exist_ok=True)
    text = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    (folder / RUN_FILE).write_text(json.dumps({"user_metadata": text}))


def _user_metadata(gw: Gateway, job_id: str) -> dict[str, str]:
    if gw.settings.checkpoint_root is None:
        return {}
    try:
        kept = json.loads((Path(gw.settings.checkpoint_root) / job_id / RUN_FILE).read_text())
        return dict(kept["user_metadata"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _checkpoints(gw: Gateway, caller: Caller, job: JobInfo) -> list[dict]:
    """The run's checkpoints, newest first."""
    found = []
    states = _states(gw, job.job_id)
    for folder in sorted(states.iterdir()) if states.is_dir() else []:
        if _owned(folder, caller):
            path = _path_of(job.job_id, folder.name)
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            saved_at = (folder / SESSION_FILE).stat().st_mtime
            found.append(_checkpoint(path, saved_at, size, _expires_at(folder)))
    on_disk = {c["tinker_path"] for c in found}
    live = gw.models.live_job(job.job_id)
    for name, saved_at in (live.sampler_names if live else {}).items():
        path = TinkerPath(job.job_id, SAMPLER_KIND, name)
        if str(path) not in on_disk:  # being saved
            found.append(_checkpoint(path, saved_at))
    return sorted(found, key=lambda c: c["time"], reverse=True)


def _path_of(job_id: str, state_name: str) -> TinkerPath:
    """The Tinker path of a state folder (see TinkerPath.trainer_name)."""
    for kind, prefix in ((EXTERNAL_KIND, EXTERNAL_PREFIX), (SAMPLER_KIND, SAMPLER_PREFIX)):
        if state_name.startswith(prefix):
            return TinkerPath(job_id, kind, state_name.removeprefix(prefix))
    return TinkerPath(job_id, STATE_KIND, state_name)


def _checkpoint(
    path: TinkerPath, saved_at: float, size: int | None = None, expires_at: float | None = None
) -> dict:
    kind = {STATE_KIND: "training", SAMPLER_KIND: "sampler", EXTERNAL_KIND: "external"}[path.kind]
    return {
        "checkpoint_id": f"{path.kind}/{path.name}",
        "checkpoint_type": kind,
        "time": _iso(saved_at),
        "tinker_path": str(path),
        "size_bytes": size,
        "expires_at": None if expires_at is None else _iso(expires_at),
    }


def _expires_at(folder: Path) -> float | None:
    try:
        return float(json.loads((folder / TTL_FILE).read_text())["expires_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _states(gw: Gateway, run_id: str) -> Path:
    root = gw.settings.checkpoint_root
    if root is None:
        raise FailedPreconditionError(
            "checkpoints: this gateway has no checkpoint_root (OPENTINKER_GATEWAY_CHECKPOINT_ROOT, "
            "the workers' shared checkpoint folder), so it cannot list or delete them"
        )
    return Path(root) / run_id / "states"


def _owned(folder: Path, caller: Caller) -> bool:
    try:
        saved = json.loads((folder / SESSION_FILE).read_text())
    except (OSError, ValueError):
        return False
    return saved.get("tenant_id") == caller.tenant_id


def _count(body: dict, name: str, default: int) -> int:
    """A page's ``limit`` or ``offset`` (a query parameter): a whole number >= 0."""
    value = body.get(name) or default
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = -1
    if count < 0:
        raise InvalidArgumentError(f"{name}: {value!r} is not a whole number >= 0")
    return count


def _iso(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s or 0, tz=UTC).isoformat()
