"""Where a job spec's paths really lead, checked on the worker before any process reads them.

The scheduler refuses, from the text alone, a path that names another tenant's job
(``scheduler/jobs/spec_paths.py``). The worker sees the filesystem: it resolves each path
(symbolic links, ``..``; a relative one from the attempt's folder, the processes' working
directory) and a path that leads into its run root or its checkpoint root must lead into the
folder of this job or of a job the path itself names (the scheduler made sure those are the
tenant's). A link in one's own folder pointing at another tenant's checkpoint, or a path to the
service's own files there (the gateway's download secret, another job's launch files), is
refused before the job's processes start, naming the field. So is a path the job's processes
(which run as the worker's user) cannot read: a model file of mode 0600 and another owner
failed the job later with the loader's "No such file or directory", naming neither the file
nor the cause.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from opentinker.common.v1 import common_pb2
from opentinker.services.common.spec_paths import named_job_ids, spec_paths


def refused_path(
    spec: common_pb2.JobSpec, *, job_id: str, cwd: Path, roots: Iterable[Path]
) -> str | None:
    """Why a path of ``spec`` may not be read by job ``job_id``'s processes, or None when
    every one may. roots: the service's folders on this worker (run root, checkpoint root)."""
    real_roots = [Path(os.path.realpath(root)) for root in roots]
    for field, path in spec_paths(spec).items():
        real = Path(os.path.realpath(cwd / path))
        if outside_own := _into_another_folder(real, real_roots, {job_id, *named_job_ids(path)}):
            return (
                f"{field}: {path!r} leads to {str(real)!r}, inside the service's own folder "
                f"{outside_own!r} but not into the folder of this job or of a job the path "
                "names; name a checkpoint of one of your tenant's jobs by its own path"
            )
        if unreadable := _unreadable(real):
            return f"{field}: {path!r}: {unreadable}"
    return None


def _into_another_folder(real: Path, roots: list[Path], allowed: set[str]) -> str | None:
    """The service folder ``real`` lies in when it is not a job folder in ``allowed``; None
    when it is, or when ``real`` is outside them all (the operator's models and data)."""
    inside = [root for root in roots if real.is_relative_to(root)]
    if not inside:
        return None
    root = max(inside, key=lambda r: len(r.parts))  # the checkpoint root in the run root
    owner = real.relative_to(root).parts[:1]  # each job's folder is named by its id
    return None if owner and owner[0] in allowed else str(root)


def _unreadable(path: Path) -> str | None:
    """Why the worker's user cannot read ``path`` or a file directly in it (a model folder's
    weights, config, tokenizer), or None (also when it does not exist here: a hub id, or a
    path the job itself reports missing)."""
    if not path.exists():
        return None
    entries = [
        path,
        *(sorted(path.iterdir()) if path.is_dir() and os.access(path, os.X_OK) else []),
    ]
    for entry in entries:
        wanted = os.R_OK | (os.X_OK if entry.is_dir() else 0)
        if not os.access(entry, wanted):
            st = entry.stat()
            return (
                f"{entry} cannot be read by the worker's user (uid {os.geteuid()}): mode "
                f"{st.st_mode & 0o777:o}, owner uid {st.st_uid}; make it readable to that user"
            )
    return None
