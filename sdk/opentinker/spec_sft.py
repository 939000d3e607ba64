"""The SFT part of a job spec: chat data, batches by token budget, how long, how often.

Example::

    spec = JobSpec(
        kind="sft",
        model=ModelSpec(base_model="Qwen/Qwen2.5-1.5B", finetune="lora"),
        sft=SftConfig(dataset_path="/data/chats.jsonl", epochs=2, learning_rate=1e-4),
    )

``dataset_path`` (and ``validation_path``) are paths on the pool's filesystem, read by the
job's trainer: the client cannot see them and checks only their form.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from opentinker.common.v1 import common_pb2

DATASET_SUFFIXES = (".jsonl", ".parquet")
DEFAULT_VALIDATION_FRACTION = 0.05


class SftConfig(BaseModel):
    """One SFT run. Rows are ``{"messages": [{"role", "content", "weight"?}]}``; the loss is on
    assistant tokens only, each multiplied by its message's weight (default 1, 0 = skip)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset_path: str = Field(
        ..., min_length=1, description="A .jsonl or .parquet file on the pool's filesystem."
    )
    validation_fraction: float | None = Field(
        None,
        gt=0,
        le=0.5,
        description="Rows held out for validation loss (default 0.05 unless validation_path).",
    )
    validation_path: str | None = Field(
        None, min_length=1, description="A second file used as the validation set."
    )
    epochs: int = Field(1, ge=1, le=10_000, description="Passes over the training rows.")
    steps: int | None = Field(
        None, ge=1, le=10_000_000, description="Optimizer steps; when set, wins over epochs."
    )
    learning_rate: float = Field(1e-5, gt=0, le=1.0)
    max_tokens_per_batch: int = Field(
        8192, ge=16, le=10_000_000, description="Tokens (padding included) per optimizer step."
    )
    packing: bool = Field(False, description="Pack conversations into shared sequences.")
    max_sequence_length: int = Field(2048, ge=8, le=1_000_000)
    seed: int = Field(0, ge=0)
    checkpoint_every: int = Field(0, ge=0, description="Steps between checkpoints; 0 = final.")
    eval_every: int = Field(0, ge=0, description="Steps between validation losses; 0 = end.")
    max_grad_norm: float = Field(1.0, gt=0)

    @field_validator("dataset_path", "validation_path")
    @classmethod
    def _known_format(cls, value: str | None) -> str | None:
        if value is not None and not value.endswith(DATASET_SUFFIXES):
            raise ValueError(f"must end in .jsonl or .parquet, got {value!r}")
        return value

    @model_validator(mode="after")
    def _check(self) -> SftConfig:
        problems = []
        if self.validation_path is not None and self.validation_fraction is not None:
            problems.append("validation_fraction: give either it or validation_path, not both")
        if self.max_sequence_length > self.max_tokens_per_batch:
            problems.append(
                f"max_tokens_per_batch: {self.max_tokens_per_batch} is smaller than "
                f"max_sequence_length {self.max_sequence_length}; one sequence must fit a batch"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def held_out_fraction(self) -> float:
        """The validation fraction in effect (0 when validation_path is given)."""
        if self.validation_path is not None:
            return 0.0
        return self.validation_fraction or DEFAULT_VALIDATION_FRACTION


# Numeric SftConfig fields taken from the wire when set (proto3 cannot tell 0 from unset).
_SFT_NUMBERS = (
    "epochs",
    "steps",
    "learning_rate",
    "max_tokens_per_batch",
    "max_sequence_length",
    "seed",
    "checkpoint_every",
    "eval_every",
    "max_grad_norm",
)


def sft_to_proto(sft: SftConfig) -> common_pb2.SftConfig:
    pb = common_pb2.SftConfig(
        dataset_path=sft.dataset_path,
        validation_path=sft.validation_path or "",
        epochs=sft.epochs,
        steps=sft.steps or 0,
        learning_rate=sft.learning_rate,
        max_tokens_per_batch=sft.max_tokens_per_batch,
        packing=sft.packing,
        max_sequence_length=sft.max_sequence_length,
        seed=sft.seed,
        checkpoint_every=sft.checkpoint_every,
        eval_every=sft.eval_every,
        max_grad_norm=sft.max_grad_norm,
    )
    if sft.validation_fraction is not None:
        pb.validation_fraction = sft.validation_fraction
    return pb


def sft_fields(pb: common_pb2.SftConfig) -> dict:
    """The set fields of a wire SftConfig, as JobSpec input (unset = the model's default)."""
    sft: dict = {"dataset_path": pb.dataset_path, "packing": pb.packing}
    for key in _SFT_NUMBERS:
        value = getattr(pb, key)
        if value:
            sft[key] = value
    if pb.validation_path:
        sft["validation_path"] = pb.validation_path
    if pb.HasField("validation_fraction"):
        sft["validation_fraction"] = pb.validation_fraction
    return sft
