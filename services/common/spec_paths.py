"""Which fields of a job spec hold paths on the workers, and which job ids a path names.

The protocol marks each JobSpec field that holds a path on the workers' filesystem
(``[(opentinker.common.v1.worker_path) = true]`` in common.proto: the model, a starting adapter,
an adapter to serve, the SFT datasets) and ``spec_paths`` finds them by that mark at any depth,
so a path field added later is checked without touching this file
(``tests/scheduler/test_spec_paths.py`` fails on a string field of JobSpec that is neither marked
nor listed there as not a path). The scheduler (``scheduler/jobs/spec_paths.py``) and the worker
(``worker/spec_paths.py``) check them.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from opentinker.common.v1 import common_pb2

JOB_ID = re.compile(r"job-[0-9a-f]{12}")


def spec_paths(spec: Message) -> dict[str, str]:
    """The set fields of ``spec`` (a JobSpec, or any message in it) that hold paths on the
    workers, by dotted name (``model.init_adapter``; ``x[1]`` for a repeated field's second):
    every field marked ``worker_path`` in the protocol, at any depth."""
    found: dict[str, str] = {}
    for field, value in spec.ListFields():
        repeated = field.is_repeated
        items = enumerate(value) if repeated else [(None, value)]
        is_message = field.type == FieldDescriptor.TYPE_MESSAGE
        if is_message and field.message_type.GetOptions().map_entry:
            continue  # maps (env_options) are the env's, not paths on the workers
        for index, item in items:
            name = field.name if index is None else f"{field.name}[{index}]"
            if is_message:
                found.update({f"{name}.{inner}": p for inner, p in spec_paths(item).items()})
            elif field.GetOptions().Extensions[common_pb2.worker_path] and item:
                found[name] = item
    return found


def named_job_ids(path: str) -> list[str]:
    """The job ids among a path's parts (``/ckpt/job-0123456789ab/states/s1`` -> that id)."""
    return [part for part in PurePosixPath(path).parts if JOB_ID.fullmatch(part)]
