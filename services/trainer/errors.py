"""Why a training job fails, as typed errors whose message is the job's failure reason."""

from __future__ import annotations

from opentinker.errors import OpenTinkerError


class RolloutError(OpenTinkerError, RuntimeError):
    """The rollout failed, closed its stream, broke the protocol or missed a deadline."""


class WeightSyncError(OpenTinkerError, RuntimeError):
    """The rollout does not serve the weights the trainer sent (probe mismatch, wrong version)."""


class CheckpointError(OpenTinkerError, RuntimeError):
    """A checkpoint cannot be written or resumed from (incomplete, inconsistent, unreadable)."""
