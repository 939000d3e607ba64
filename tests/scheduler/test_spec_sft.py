"""SFT job specs: validated naming the field, and identical after a trip over the wire."""

from __future__ import annotations

import pytest

from opentinker import ConfigError, JobSpec, ModelSpec, SftConfig
from opentinker.common.v1 import common_pb2
from opentinker.spec import from_proto, parse_job_spec, to_proto

pytestmark = pytest.mark.unit


def test_sft_round_trip_keeps_every_field() -> None:
    spec = JobSpec(
        kind="sft",
        model=ModelSpec(base_model="/models/tiny", finetune="lora", init_adapter="/ckpt/a"),
        sft=SftConfig(
            dataset_path="/data/chat.jsonl",
            validation_fraction=0.2,
            epochs=3,
            steps=40,
            learning_rate=2e-4,
            max_tokens_per_batch=4096,
            packing=True,
            max_sequence_length=512,
            seed=7,
            checkpoint_every=10,
            eval_every=5,
            max_grad_norm=0.5,
        ),
    )
    pb = to_proto(spec)
    assert pb.kind == common_pb2.JOB_KIND_SFT and pb.model.init_adapter == "/ckpt/a"
    assert from_proto(pb) == spec


def test_defaults_survive_the_wire() -> None:
    spec = JobSpec(kind="sft", sft=SftConfig(dataset_path="d.parquet", validation_path="v.jsonl"))
    back = from_proto(to_proto(spec))
    assert back == spec
    assert back.sft is not None and back.sft.validation_fraction is None
    assert back.sft.held_out_fraction == 0.0
    assert SftConfig(dataset_path="d.jsonl").held_out_fraction == 0.05


def test_sft_job_without_sft_config_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="sft: an SFT job needs `sft`"):
        parse_job_spec({"kind": "sft"})
    with pytest.raises(ConfigError, match="needs `sft`"):
        from_proto(common_pb2.JobSpec(kind=common_pb2.JOB_KIND_SFT))


def test_bad_sft_fields_are_named_all_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        parse_job_spec(
            {
                "kind": "sft",
                "sft": {"dataset_path": "data.csv", "epochs": 0, "learning_rate": -1},
            }
        )
    message = str(info.value)
    for field in ("sft.epochs", "sft.learning_rate"):
        assert field in message, message
    with pytest.raises(ConfigError, match="sft.dataset_path: Value error, must end in .jsonl"):
        parse_job_spec({"kind": "sft", "sft": {"dataset_path": "data.csv"}})
    with pytest.raises(ConfigError, match="max_tokens_per_batch"):
        parse_job_spec(
            {
                "kind": "sft",
                "sft": {
                    "dataset_path": "d.jsonl",
                    "max_tokens_per_batch": 100,
                    "max_sequence_length": 200,
                },
            }
        )
    with pytest.raises(ConfigError, match="validation_fraction: give either"):
        parse_job_spec(
            {
                "kind": "sft",
                "sft": {
                    "dataset_path": "d.jsonl",
                    "validation_path": "v.jsonl",
                    "validation_fraction": 0.1,
                },
            }
        )


def test_starting_adapter_needs_lora() -> None:
    with pytest.raises(ConfigError, match="init_adapter: a starting adapter needs finetune"):
        parse_job_spec(
            {
                "model": {"finetune": "full", "init_adapter": "/ckpt/a"},
                "rl": {"env_name": "letter"},
            }
        )
