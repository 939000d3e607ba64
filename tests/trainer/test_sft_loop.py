"""The SFT loop in-process: a real tiny model, a real (recording) scheduler over gRPC.
It lowers validation loss, saves a from_pretrained checkpoint that answers in the trained
format, resumes from its checkpoint, stops when cancelled, and fails naming a bad row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sft_helpers import answer_format_rows, write_jsonl
from trainer_loop_helpers import run_sft
from transformers import AutoModelForCausalLM, AutoTokenizer

from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rl.loop import Outcome
from opentinker.spec import JobSpec, ModelSpec, SftConfig

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


def sft_spec(model_dir: Path, data: Path, **sft: object) -> JobSpec:
    options: dict = {
        "dataset_path": str(data),
        "validation_fraction": 0.1,
        "epochs": 6,
        "learning_rate": 3e-3,
        "max_tokens_per_batch": 512,
        "max_sequence_length": 64,
        "packing": True,
        "eval_every": 8,
    }
    options.update(sft)
    return JobSpec(
        kind="sft",
        model=ModelSpec(base_model=str(model_dir), finetune="full"),
        sft=SftConfig(**options),
    )


def greedy_reply(model, tokenizer, question: str) -> str:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([list(ids)]), max_new_tokens=16, do_sample=False
        )
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_full_sft_lowers_val_loss_and_its_checkpoint_answers_the_format(
    model_dir: Path, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", answer_format_rows(160))
    outcome, recorder = run_sft(sft_spec(model_dir, data), tmp_path / "ckpt")
    assert outcome is Outcome.SUCCEEDED
    steps = recorder.of("step")
    val = [s.metrics["val/loss"] for s in steps if "val/loss" in s.metrics]
    (result,) = recorder.of("result")
    initial = result.final_metrics["val/loss_initial"]
    assert val[-1] < initial - 3.0, (initial, val)  # measured: 6.23 -> ~0.4
    assert [s.step for s in steps] == list(range(1, len(steps) + 1))
    for key in ("train/loss", "tokens_per_s", "grad_norm", "tokens_trained", "epoch"):
        assert key in steps[-1].metrics, key
    assert 0.05 < steps[-1].metrics["memory_resident_gib"] < 64  # the trainer's, torch in it
    assert result.final_metrics["steps"] == len(steps)

    # The checkpoint is a Hugging Face model: from_pretrained, then greedy replies in format.
    model = AutoModelForCausalLM.from_pretrained(result.checkpoint_uri).eval()
    tokenizer = AutoTokenizer.from_pretrained(result.checkpoint_uri)
    for question in ("what is the move", "close the door", "you win"):
        assert greedy_reply(model, tokenizer, question).startswith("ANSWER: "), question
    # ... and it is a base_model a later job loads like any other.
    assert Policy(ModelSpec(base_model=result.checkpoint_uri, finetune="full"), learning_rate=1e-5)

    # A second attempt of the same job resumes from the last checkpoint and trains on.
    longer = sft_spec(model_dir, data, steps=len(steps) + 2)
    outcome, recorder = run_sft(longer, tmp_path / "ckpt")
    assert outcome is Outcome.SUCCEEDED
    assert [s.step for s in recorder.of("step")] == [len(steps) + 1, len(steps) + 2]
    assert "resumed from checkpoint" in recorder.of("log")[0].message
    (result,) = recorder.of("result")
    assert result.final_metrics["val/loss_initial"] == pytest.approx(initial)


def test_cancel_stops_the_loop_and_bad_rows_fail_it_naming_the_line(
    model_dir: Path, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", answer_format_rows(40))
    outcome, recorder = run_sft(sft_spec(model_dir, data), tmp_path / "c1", stop_at=2)
    assert outcome is Outcome.CANCELLED
    assert [s.step for s in recorder.of("step")] == [1, 2] and not recorder.of("result")

    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text() + json.dumps({"messages": [{"role": "x"}]}) + "\n")
    outcome, recorder = run_sft(sft_spec(model_dir, bad), tmp_path / "c2")
    assert outcome is Outcome.FAILED
    (failure,) = recorder.of("failure")
    assert f"{bad}:41: messages[0].role" in failure.reason
