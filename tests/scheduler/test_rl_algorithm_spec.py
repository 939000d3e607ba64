"""The RL algorithm's knobs in RlConfig: defaults, validation naming the field, wire round trip."""

from __future__ import annotations

import pytest

from opentinker import ConfigError, JobSpec, RlConfig
from opentinker.common.v1 import common_pb2
from opentinker.spec import from_proto, parse_job_spec, to_proto

pytestmark = pytest.mark.unit


def test_defaults_keep_grpo_with_one_update_per_batch() -> None:
    rl = RlConfig(env_name="letter")
    assert (rl.loss, rl.loss_normalization, rl.ppo_epochs, rl.minibatch_size) == (
        "grpo", "sequence", 1, 0,
    )  # fmt: skip
    assert (rl.kl_coef, rl.entropy_coef, rl.max_grad_norm, rl.gamma) == (0.0, 0.0, 1.0, 1.0)
    # an empty wire RlConfig gives the same defaults
    pb = common_pb2.JobSpec(kind=common_pb2.JOB_KIND_RL, rl=common_pb2.RlConfig(env_name="letter"))
    assert from_proto(pb).rl == rl


def test_every_algorithm_field_round_trips_through_the_wire() -> None:
    spec = JobSpec(
        rl=RlConfig(
            env_name="letter",
            loss="ppo",
            loss_normalization="constant",
            ppo_epochs=4,
            minibatch_size=8,
            kl_coef=0.05,
            kl_estimator="k1",
            kl_in_reward=True,
            entropy_coef=0.01,
            warmup_steps=3,
            lr_schedule="cosine",
            weight_decay=0.1,
            max_grad_norm=0.0,  # 0 (no clip) survives: the wire field is `optional`
            gamma=0.0,
            gae_lambda=0.0,
            critic_learning_rate=1e-3,
            micro_batch_tokens=4096,
            max_padding_fraction=0.0,  # 0 (every length its own pass) survives: `optional`
            old_logprobs="trainer",
            tis_cap=0.0,  # no importance weights: survives too
        )
    )
    assert from_proto(to_proto(spec)) == spec
    unset = from_proto(to_proto(JobSpec(rl=RlConfig(env_name="letter"))))
    assert unset.rl.max_padding_fraction == 0.25
    assert unset.rl.old_logprobs == "auto" and unset.rl.tis_cap == 2.0
    rollout = JobSpec(rl=RlConfig(env_name="letter", old_logprobs="rollout"))
    assert from_proto(to_proto(rollout)) == rollout
    for loss in ("grpo", "rloo", "reinforce"):
        other = JobSpec(rl=RlConfig(env_name="letter", loss=loss, lr_schedule="linear"))
        assert from_proto(to_proto(other)) == other


@pytest.mark.parametrize(
    ("rl", "field"),
    [
        ({"loss": "ppo"}, "critic_learning_rate: loss 'ppo' trains a value head"),
        ({"loss": "rloo", "critic_learning_rate": 0.1}, "critic_learning_rate: only 'ppo'"),
        ({"kl_in_reward": True}, "kl_in_reward: needs kl_coef > 0"),
        ({"kl_coef": 0.1, "kl_estimator": "k1"}, "kl_estimator: k1 in the loss has a gradient"),
        ({"steps": 5, "warmup_steps": 6}, "warmup_steps"),
        ({"prompts_per_step": 2, "samples_per_prompt": 4, "minibatch_size": 9}, "minibatch_size"),
        ({"micro_batch_tokens": 100}, "micro_batch_tokens: 100 cannot hold one episode"),
        ({"loss": "a2c"}, "rl.loss"),
        ({"loss_normalization": "batch"}, "rl.loss_normalization"),
        ({"ppo_epochs": 0}, "rl.ppo_epochs"),
        ({"gamma": 1.5}, "rl.gamma"),
        ({"max_padding_fraction": 1.5}, "rl.max_padding_fraction"),
        ({"old_logprobs": "sampler"}, "rl.old_logprobs"),
        ({"tis_cap": -1.0}, "rl.tis_cap"),
    ],
)
def test_invalid_settings_are_refused_naming_the_field(rl: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        parse_job_spec({"rl": {"env_name": "letter", **rl}})


def test_unknown_enum_values_on_the_wire_are_refused() -> None:
    pb = to_proto(JobSpec(rl=RlConfig(env_name="letter")))
    pb.rl.lr_schedule = 99  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="rl.lr_schedule"):
        from_proto(pb)
