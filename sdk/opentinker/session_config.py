"""The settings of a training session job (``JobSpec(kind="session", session=...)``).

A session is a job like any other: it is queued, holds a lease while it runs, is accounted,
and ends when the user closes it or after ``idle_timeout_s`` without a call.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from opentinker.common.v1 import common_pb2


class SessionConfig(BaseModel):
    """How a training session behaves; every time is seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    idle_timeout_s: float = Field(
        600.0, gt=0, le=7 * 24 * 3600, description="End (and free the lease) after this idle."
    )
    seed: int = Field(0, ge=0, description="torch seed of the LoRA init and dropout.")
    max_batch_tokens: int = Field(
        65536, ge=1, description="Most input tokens in one forward/forward_backward call."
    )
    order_wait_s: float = Field(
        30.0, gt=0, description="How long a call that came early waits for its predecessor."
    )

    def to_proto(self) -> common_pb2.SessionConfig:
        return common_pb2.SessionConfig(
            idle_timeout_s=self.idle_timeout_s,
            seed=self.seed,
            max_batch_tokens=self.max_batch_tokens,
            order_wait_s=self.order_wait_s,
        )

    @staticmethod
    def fields_from_proto(pb: common_pb2.SessionConfig) -> dict:
        """The set fields of a wire SessionConfig (unset = the default), as model input."""
        data = {
            "idle_timeout_s": pb.idle_timeout_s,
            "seed": pb.seed,
            "max_batch_tokens": pb.max_batch_tokens,
            "order_wait_s": pb.order_wait_s,
        }
        return {k: v for k, v in data.items() if v}
