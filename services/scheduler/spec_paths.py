"""A job spec's file paths may name only the caller's tenant's jobs.

``model.base_model``, ``inference.adapter_dir`` and ``sft.dataset_path``/``validation_path``
are paths on the workers' filesystem, read as they are by the job's processes. A job's own
outputs lie under a folder named by its id (``<checkpoint_root>/<job-id>/…``, ``runs/…/<job-id>``),
so a path with another tenant's job id in it (a saved adapter, an SFT model) would have the
job sample from, or train on, that tenant's weights: the checks that ``LoadState`` and the
gateway make on ``tinker://`` paths, skipped. Every job id a path names must be one of the
caller's tenant's jobs; another tenant's is refused as one that does not exist (its existence
is not told). Job ids are random, so this is a second line, not the only one.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from opentinker.common.v1 import common_pb2
from opentinker.errors import ConfigError
from opentinker.services.scheduler.errors import JobNotFoundError
from opentinker.services.scheduler.job_store import JobStore
from opentinker.spec import from_proto

JOB_ID = re.compile(r"job-[0-9a-f]{12}")


def spec_paths(spec: common_pb2.JobSpec) -> dict[str, str]:
    """The spec's fields that hold paths on the workers, by name (the set ones)."""
    paths = {
        "model.base_model": spec.model.base_model,
        "inference.adapter_dir": spec.inference.adapter_dir,
        "sft.dataset_path": spec.sft.dataset_path,
        "sft.validation_path": spec.sft.validation_path,
    }
    return {field: path for field, path in paths.items() if path}


def named_job_ids(path: str) -> list[str]:
    """The job ids among a path's parts (``/ckpt/job-0123456789ab/states/s1`` -> that id)."""
    return [part for part in PurePosixPath(path).parts if JOB_ID.fullmatch(part)]


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
