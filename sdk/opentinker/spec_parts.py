"""Pieces every kind of job spec shares: the strict base model and the sampling parameters."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from opentinker.common.v1 import common_pb2


class StrictModel(BaseModel):
    """Unknown fields are an error; a validated spec never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingParams(StrictModel):
    temperature: float = Field(1.0, gt=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(64, ge=1, le=32768)


def sampling_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens
    )


def sampling_fields(s: common_pb2.SamplingParams) -> dict:
    """The set fields of a wire SamplingParams, as spec input (unset = the model's default)."""
    fields = {"temperature": s.temperature, "top_p": s.top_p, "max_new_tokens": s.max_new_tokens}
    return {k: v for k, v in fields.items() if v}
