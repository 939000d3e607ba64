"""The rollout stream's envelopes from domain values: trajectories and batches to protobuf,
domain errors to gRPC status code names (RolloutFailed carries the name)."""

from __future__ import annotations

import time

from opentinker.common.v1 import common_pb2
from opentinker.envhub.v1 import environment_pb2
from opentinker.errors import (
    EnvironmentError_,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    OpenTinkerError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
)
from opentinker.grpc_options import MAX_MESSAGE_BYTES
from opentinker.rollout.v1 import rollout_pb2
from opentinker.services.rollout.types import FinishReason, Trajectory, TrajectoryBatch

# A TrajectoryBatch larger than this goes to the trainer in parts (TrajectoryBatch.more): gRPC
# refuses to send a message past MAX_MESSAGE_BYTES, which would end the stream.
BATCH_PART_BYTES = MAX_MESSAGE_BYTES // 2
# What a part carries beside its trajectories (the response's seq, the batch's index and
# figures): well under this. A trajectory that leaves less room cannot travel at all.
ENVELOPE_BYTES = 1024

_CODES: list[tuple[type[OpenTinkerError], str]] = [
    (InvalidArgumentError, "INVALID_ARGUMENT"),
    (FailedPreconditionError, "FAILED_PRECONDITION"),
    (PermissionDeniedError, "PERMISSION_DENIED"),
    (ResourceExhaustedError, "RESOURCE_EXHAUSTED"),
    (NotFoundError, "NOT_FOUND"),
    (UnavailableError, "UNAVAILABLE"),
    (EnvironmentError_, "UNAVAILABLE"),
]
_FINISH_TO_PB = {
    FinishReason.ENV_DONE: rollout_pb2.FINISH_REASON_ENV_DONE,
    FinishReason.MAX_TURNS: rollout_pb2.FINISH_REASON_MAX_TURNS,
    FinishReason.MAX_TOKENS: rollout_pb2.FINISH_REASON_MAX_TOKENS,
    FinishReason.ENV_ERROR: rollout_pb2.FINISH_REASON_ENV_ERROR,
}


def code_of(err: OpenTinkerError) -> str:
    """The gRPC status code name for a domain error: its own, else the one its type means."""
    if err.code:
        return err.code
    for error_type, code in _CODES:
        if isinstance(err, error_type):
            return code
    return "INTERNAL"


def failed(reason: str, code: str) -> rollout_pb2.RolloutResponse:
    return rollout_pb2.RolloutResponse(failed=rollout_pb2.RolloutFailed(reason=reason, code=code))


def heartbeat() -> rollout_pb2.RolloutResponse:
    return rollout_pb2.RolloutResponse(heartbeat=common_pb2.Heartbeat(time_unix_s=time.time()))


def trajectory_to_proto(t: Trajectory) -> rollout_pb2.Trajectory:
    return rollout_pb2.Trajectory(
        episode_id=t.episode_id,
        group_index=t.group_index,
        policy_version=t.policy_version,
        token_ids=t.token_ids,
        prompt_length=t.prompt_length,
        logprobs=t.logprobs,
        loss_mask=t.loss_mask,
        reward=t.reward,
        num_turns=t.num_turns,
        finish_reason=_FINISH_TO_PB[t.finish_reason],
        finish_detail=t.finish_detail,
        completion_text=t.completion_text,
        info=t.info,
        env_retries=t.env_retries,
        turn_rewards=t.turn_rewards,
        turn_ends=t.turn_ends,
        images=[environment_pb2.ImagePart(data=i.data, mime_type=i.mime_type) for i in t.images],
        role=t.role,
    )


def batch_to_proto(batch: TrajectoryBatch) -> rollout_pb2.TrajectoryBatch:
    return rollout_pb2.TrajectoryBatch(
        batch_index=batch.batch_index,
        trajectories=[trajectory_to_proto(t) for t in batch.trajectories],
        generate_seconds=batch.stats.generate_seconds,
        env_seconds=batch.stats.env_seconds,
        generated_tokens=batch.stats.generated_tokens,
    )


def batch_parts(
    batch: TrajectoryBatch, *, max_bytes: int = BATCH_PART_BYTES
) -> list[rollout_pb2.TrajectoryBatch]:
    """The batch as messages of at most ``max_bytes`` of trajectories each (a larger
    trajectory goes alone), in order: every one but the last has ``more`` set, the figures
    travel on the last. One message when it fits. ResourceExhaustedError naming the episode
    when a trajectory alone is too large for a message (gRPC would refuse to send it)."""
    whole = batch_to_proto(batch)
    parts = [rollout_pb2.TrajectoryBatch(batch_index=batch.batch_index)]
    size = 0
    for trajectory in whole.trajectories:
        nbytes = trajectory.ByteSize()
        _check_fits(trajectory, nbytes)
        if size and size + nbytes > max_bytes:
            parts[-1].more = True
            parts.append(rollout_pb2.TrajectoryBatch(batch_index=batch.batch_index))
            size = 0
        parts[-1].trajectories.append(trajectory)
        size += nbytes
    del whole.trajectories[:]
    parts[-1].MergeFrom(whole)  # the figures
    return parts


def _check_fits(trajectory: rollout_pb2.Trajectory, nbytes: int) -> None:
    """ResourceExhaustedError naming the episode when its trajectory cannot travel alone."""
    if nbytes <= MAX_MESSAGE_BYTES - ENVELOPE_BYTES:
        return
    info = sum(len(k.encode()) + len(v.encode()) for k, v in trajectory.info.items())
    images = sum(len(i.data) for i in trajectory.images)
    raise ResourceExhaustedError(
        f"episode {trajectory.episode_id}'s trajectory is {nbytes} bytes, more than one message "
        f"to the trainer carries ({MAX_MESSAGE_BYTES} bytes less {ENVELOPE_BYTES} for the "
        f"envelope); of it, its env's info is {info} bytes and its images {images} bytes, and "
        f"its {len(trajectory.token_ids)} tokens the rest: have the env return less (large "
        "logs belong in its own files), or lower max_episode_tokens",
        code="RESOURCE_EXHAUSTED",
    )
