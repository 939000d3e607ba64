"""A job whose ``model.base_model`` is a GGUF file: imported once per worker, then loaded as a
folder.

The worker turns the file into the Hugging Face folder every process loads
(``modeling/gguf_import.py``) under ``<run_root>/models/<name>-<key>``, the key made of the
file's real path, size and modification time (a replaced file is imported again), and hands the
job's processes that folder as their ``base_model``. The import runs as its own process
(``opentinker models import``: torch and the dequantized weights stay out of the worker) and one
at a time per file, across jobs and workers sharing the run root (a lock file): the first job
waits for it (SmolLM2-135M: about 50 s on 2 cores), the others find the folder made.
A relative path is read from the attempt's folder, as the processes would read it.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import sys
from pathlib import Path

import structlog

from opentinker.common.v1 import common_pb2
from opentinker.services.modeling.gguf_import import import_key

log = structlog.get_logger(__name__)


async def with_imported_model(
    job: common_pb2.Job, *, cwd: Path, models_root: Path
) -> tuple[common_pb2.Job, str | None]:
    """``job`` with a GGUF ``base_model`` replaced by its imported folder, and None; or the
    job as it is and why the GGUF cannot be used (the import's own words)."""
    base = job.spec.model.base_model
    if not base.endswith(".gguf"):
        return job, None
    source = Path(os.path.realpath(cwd / base))
    if not source.is_file():
        return job, f"model.base_model: {base!r}: no such GGUF file on worker ({source})"
    folder = models_root / f"{source.stem}-{import_key(source)}"
    if not folder.exists():
        failed = await _import_once(source, folder)
        if failed is not None:
            return job, f"model.base_model: {base!r}: {failed}"
    resolved = common_pb2.Job()
    resolved.CopyFrom(job)
    resolved.spec.model.base_model = str(folder)
    return resolved, None


async def _import_once(source: Path, folder: Path) -> str | None:
    """Import ``source`` into ``folder`` unless another job did meanwhile; None when done."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with (folder.parent / f".{folder.name}.lock").open("w") as lock:
        await asyncio.to_thread(fcntl.flock, lock, fcntl.LOCK_EX)  # released on close
        if folder.exists():
            return None
        log.info("gguf_import_started", gguf=str(source), out=str(folder))
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "opentinker", "models", "import", str(source),
            "--out", str(folder),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await process.communicate()
        if process.returncode == 0:
            log.info("gguf_imported", out=str(folder))
            return None
        said = " ".join(output.decode(errors="replace").split())
        reason = said.rsplit("error: ", 1)[-1][-500:] if said else f"exit {process.returncode}"
        log.warning("gguf_import_failed", gguf=str(source), reason=reason)
        return f"could not import it: {reason}"
