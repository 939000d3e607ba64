"""Where a job spec's paths really lead, checked on the worker before any process reads them.

The scheduler refuses, from the text alone, a path that names another tenant's job
(``scheduler/spec_paths.py``). The worker sees the filesystem: it resolves each path
(symbolic links, ``..``; a relative one from the attempt's folder, the processes' working
directory) and a path that leads into its run root or its checkpoint root must lead into the
folder of this job or of a job the path itself names (the scheduler made sure those are the
tenant's). A link in one's own folder pointing at another tenant's checkpoint, or a path to the
service's own files there (the gateway's download secret, another job's launch files), is
refused before the job's processes start, naming the field.
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
        inside = [root for root in real_roots if real.is_relative_to(root)]
        if not inside:
            continue  # a model or a dataset of the operator's, outside the service's folders
        root = max(inside, key=lambda r: len(r.parts))  # the checkpoint root in the run root
        owner = real.relative_to(root).parts[:1]  # each job's folder is named by its id
        if not owner or owner[0] not in {job_id, *named_job_ids(path)}:
            return (
                f"{field}: {path!r} leads to {str(real)!r}, inside the service's own folder "
                f"{str(root)!r} but not into the folder of this job or of a job the path "
                "names; name a checkpoint of one of your tenant's jobs by its own path"
            )
    return None
