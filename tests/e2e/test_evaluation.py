"""Evaluation pieces: greedy decoding, result rows and their wire limits, val/* figures, and the
scheduler's check of a reported row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from opentinker.common.v1 import common_pb2
from opentinker.errors import ConfigError
from opentinker.inference_rows import (
    MAX_COMPLETION_CHARS,
    episode_row,
    options_with_split,
    summarize,
    wire_row,
)
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.rollout.agent.seeds import derive_seed, eval_episode_seed
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.scheduler.jobs.progress import MAX_ROW_BYTES, check_row
from opentinker.services.trainer.rl.validation import validation_metrics
from opentinker.spec import ModelSpec, SamplingParams


def row(index: int, reward: float, turns: int = 1, finish: str = "ENV_DONE") -> dict:
    return episode_row(
        episode_id=f"e{index}",
        index=index,
        env_seed=index,
        reward=reward,
        turns=turns,
        finish_reason=finish,
        finish_detail="",
        info={},
        env_retries=0,
        completion_tokens=3,
    )


@pytest.mark.unit
def test_summary_and_val_metrics_of_rows_by_hand() -> None:
    rows = [row(0, 1.0), row(1, 0.0, turns=3), row(2, 0.5), row(3, 0.0, finish="ENV_ERROR")]
    s = summarize(rows)
    assert s.mean_reward == pytest.approx(0.375)  # (1 + 0 + 0.5 + 0) / 4
    assert s.accuracy == pytest.approx(0.5)  # rewards > 0: episodes 0 and 2 of 4
    assert s.mean_turns == pytest.approx(1.5)  # (1 + 3 + 1 + 1) / 4
    assert s.env_errors == 1 and s.episodes == 4
    val = validation_metrics(rows, seconds=2.0)
    assert val["val/reward_mean"] == pytest.approx(0.375) and val["val/accuracy"] == 0.5
    assert val["val/turns_mean"] == 1.5 and val["val/env_errors"] == 1.0
    assert val["val/episodes"] == 4.0 and val["val/time_s"] == 2.0


@pytest.mark.unit
def test_wire_rows_are_cut_to_their_limits_and_fit_the_scheduler() -> None:
    long = row(0, 1.0) | {"finish_detail": "d" * 900, "info": {"k": "v" * 300}}
    wired = wire_row(long, "é" * (MAX_COMPLETION_CHARS + 10))
    assert len(wired["completion"]) == MAX_COMPLETION_CHARS and wired["truncated"]
    assert len(wired["finish_detail"]) == 500 and len(wired["info"]["k"]) == 200
    check_row(common_pb2.ResultRow(json=json.dumps(wired, ensure_ascii=False), index=0))
    assert not wire_row(row(1, 0.0), "short")["truncated"]


@pytest.mark.unit
def test_the_scheduler_refuses_oversized_and_non_object_rows() -> None:
    with pytest.raises(ConfigError, match="row.json: .* over the 16384 byte limit"):
        check_row(common_pb2.ResultRow(json=json.dumps({"x": "a" * MAX_ROW_BYTES})))
    with pytest.raises(ConfigError, match="must be a JSON object"):
        check_row(common_pb2.ResultRow(json="[1, 2]"))
    with pytest.raises(ConfigError, match="not JSON"):
        check_row(common_pb2.ResultRow(json="{oops"))


@pytest.mark.unit
def test_evaluation_seeds_are_their_own_stream() -> None:
    assert eval_episode_seed(3, 5) == derive_seed(3, "env", 5)  # what `infer --local` plays
    training = {derive_seed(3, "env", b, g) for b in range(20) for g in range(20)}
    assert not training & {eval_episode_seed(3, i) for i in range(400)}


@pytest.mark.unit
def test_a_split_joins_the_options_unless_they_name_another() -> None:
    assert options_with_split({"a": "1"}, "validation") == {"a": "1", "split": "validation"}
    assert options_with_split({"a": "1"}, None) == {"a": "1"}
    with pytest.raises(ConfigError, match="contradicts"):
        options_with_split({"split": "train"}, "validation")


@pytest.mark.integration
def test_greedy_decoding_is_the_argmax_whatever_the_seed(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "tiny")
    engine = TransformersEngine.load(ModelSpec(base_model=str(model_dir), finetune="full"))
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, return_dict=False
    )
    hot = SamplingParams(temperature=5.0, max_new_tokens=6)
    first, second = (engine.generate([prompt], hot, seed, greedy=True)[0] for seed in (1, 2))
    assert first == second
    ids = list(prompt)  # the argmax, one token at a time, with logprobs at temperature 1
    for token, logprob in zip(first.token_ids, first.logprobs, strict=True):
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        assert token == int(logits.argmax())
        assert logprob == pytest.approx(torch.log_softmax(logits, -1)[token].item(), abs=1e-4)
        ids.append(token)
    sampled = {tuple(engine.generate([prompt], hot, s)[0].token_ids) for s in range(4)}
    assert len(sampled) > 1  # at temperature 5 sampling differs by seed: greedy is not that
