"""A job spec's file paths may name only the caller's tenant's jobs.

The fields of a JobSpec that hold paths on the workers (``common/spec_paths.py``: those
marked ``worker_path`` in the protocol) are read as they are by the job's processes. A job's
own outputs lie under a folder named by its id (``<checkpoint_root>/<job-id>/…``,
``runs/<job-id>/…``), so a path with another tenant's job id in it (a checkpoint, a saved
adapter, a saved state) would have the job train from, sample from or serve that tenant's
weights: the checks that ``LoadState`` and the gateway make on ``tinker://`` paths, skipped.
Every job id a path names, however it is written (absolute, or relative with ``..``), must be
one of the caller's tenant's jobs; another tenant's is refused as one that does not exist (its
existence is not told). Job ids are random, so this is a second line, not the only one; the
worker checks where each path really leads (``worker/spec_paths.py``).
"""

from __future__ import annotations

from opentinker.common.v1 import common_pb2
from opentinker.errors import ConfigError
from opentinker.services.common.spec_paths import named_job_ids, spec_paths
from opentinker.services.scheduler.errors import JobNotFoundError
from opentinker.services.scheduler.jobs.job_store import JobStore
from opentinker.spec import from_proto


async def check_spec_paths(spec: common_pb2.JobSpec, tenant_id: str, jobs: JobStore) -> None:
    """ConfigError naming the field when a path names a job that is not the tenant's."""
    for field, path in spec_paths(spec).items():
        for job_id in named_job_ids(path):
            try:
                owner = (await jobs.get(job_id)).tenant_id
            except JobNotFoundError:
                owner = None
            if owner != tenant_id:
                raise ConfigError(
                    f"{field}: {path!r} names job {job_id!r}, which is not one of your "
                    "tenant's jobs",
                    reason="PATH_OF_ANOTHER_JOB",
                )


async def check_submission(spec: common_pb2.JobSpec, tenant_id: str, jobs: JobStore) -> None:
    """A submitted spec: valid (``from_proto``: ConfigError naming the field), and its paths
    naming only the tenant's jobs."""
    from_proto(spec)
    await check_spec_paths(spec, tenant_id, jobs)
