"""Job specs: validated with every bad field named, and identical after a trip over the wire."""

from __future__ import annotations

import pytest

from opentinker import ConfigError, InferenceConfig, JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.common.v1 import common_pb2
from opentinker.spec import from_proto, parse_job_spec, to_proto

pytestmark = pytest.mark.unit


def test_round_trip_keeps_every_field() -> None:
    spec = JobSpec(
        name="x",
        model=ModelSpec(base_model="/models/tiny", finetune="full"),
        rl=RlConfig(
            env_name="letter",
            env_options={"num_letters": "4"},
            steps=7,
            prompts_per_step=3,
            samples_per_prompt=5,
            learning_rate=3e-4,
            sampling=SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=3),
            max_turns=2,
            seed=11,
            stop_at_reward=0.8,
            checkpoint_every=5,
            val_every=4,
            val_episodes=9,
            val_temperature=0.5,
            val_env_options={"split": "validation"},
            val_first_episode=100,
        ),
        num_devices=2,
    )
    assert from_proto(to_proto(spec)) == spec


def test_inference_spec_round_trips_with_every_field() -> None:
    spec = JobSpec(
        name="eval",
        kind="inference",
        model=ModelSpec(base_model="/models/tiny", finetune="full"),
        inference=InferenceConfig(
            env_name="math",
            env_options={"split": "validation"},
            episodes=40,
            concurrency=8,
            sampling=SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=3),
            max_turns=2,
            max_episode_tokens=512,
            seed=3,
            adapter_dir="/ckpt/adapter",
            greedy=True,
        ),
    )
    assert from_proto(to_proto(spec)) == spec


def test_inference_kind_needs_its_config_and_names_bad_fields() -> None:
    with pytest.raises(ConfigError, match="needs `inference`"):
        parse_job_spec({"kind": "inference"})
    with pytest.raises(ConfigError, match="`inference` is for kind 'inference'"):
        parse_job_spec({"rl": {"env_name": "letter"}, "inference": {"env_name": "letter"}})
    with pytest.raises(ConfigError) as info:
        parse_job_spec({"kind": "inference", "inference": {"env_name": "x", "episodes": 10_001}})
    assert "inference.episodes" in str(info.value)
    pb = to_proto(JobSpec(kind="inference", inference=InferenceConfig(env_name="letter")))
    pb.inference.concurrency = -2
    with pytest.raises(ConfigError, match="inference.concurrency"):
        from_proto(pb)


def test_all_problems_are_reported_at_once_with_field_names() -> None:
    with pytest.raises(ConfigError) as info:
        parse_job_spec({"rl": {"env_name": "bad name!", "steps": 0, "samples_per_prompt": 1}})
    message = str(info.value)
    for field in ("rl.env_name", "rl.steps", "rl.samples_per_prompt"):
        assert field in message, message


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(ConfigError, match="rl.stepz"):
        parse_job_spec({"rl": {"env_name": "letter", "stepz": 3}})


def test_rl_job_without_rl_config_is_refused() -> None:
    with pytest.raises(ConfigError, match="needs `rl`"):
        parse_job_spec({"name": "x"})


def test_wire_spec_without_a_kind_is_refused_naming_the_kinds_served() -> None:
    pb = common_pb2.JobSpec(kind=common_pb2.JOB_KIND_UNSPECIFIED)
    served = "'rl' or 'sft' or 'inference' or 'session'"
    with pytest.raises(ConfigError, match=f"'unspecified'.*{served}"):
        from_proto(pb)


def test_wire_spec_of_a_kind_without_its_section_is_refused_by_name() -> None:
    pb = common_pb2.JobSpec(kind=common_pb2.JOB_KIND_SFT)
    with pytest.raises(ConfigError, match="sft: an SFT job needs `sft`"):
        from_proto(pb)


def test_a_section_of_another_kind_is_refused() -> None:
    with pytest.raises(ConfigError, match="`rl` is for kind 'rl', not 'inference'"):
        parse_job_spec(
            {
                "kind": "inference",
                "rl": {"env_name": "letter"},
                "inference": {"env_name": "letter"},
            }
        )


def test_negative_numbers_on_the_wire_are_caught() -> None:
    pb = to_proto(JobSpec(rl=RlConfig(env_name="letter")))
    pb.rl.learning_rate = -1.0
    with pytest.raises(ConfigError, match="rl.learning_rate"):
        from_proto(pb)


def test_session_spec_round_trips_and_is_only_for_session_jobs() -> None:
    from pydantic import ValidationError

    from opentinker.session_config import SessionConfig

    spec = JobSpec(kind="session", session=SessionConfig(idle_timeout_s=30, seed=3))
    pb = to_proto(spec)
    assert pb.kind == common_pb2.JOB_KIND_SESSION and pb.session.idle_timeout_s == 30
    assert from_proto(pb) == spec
    with pytest.raises(ValidationError, match="session"):
        JobSpec(rl=RlConfig(env_name="letter"), session=SessionConfig())
    with pytest.raises(ValidationError, match="idle_timeout_s"):
        SessionConfig(idle_timeout_s=0)
