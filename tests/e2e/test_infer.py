"""``run_inference`` (the backend of ``opentinker infer``): the tiny model, or a LoRA adapter
trained on it, plays the built-in letter env through a real EnvHub; one jsonl line per
episode, and a summary that matches the file."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from opentinker.cli import main
from opentinker.errors import NotFoundError
from opentinker.inference_rows import summarize
from opentinker.services.envhub.server import EnvHubDeps
from opentinker.services.envhub.server import create_server as create_envhub
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.rollout.inference import load_inference_engine, run_inference
from opentinker.spec import SamplingParams

pytestmark = pytest.mark.integration

T = TypeVar("T")
PROBE = list(range(40, 72))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def adapter(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """A LoRA checkpoint as the trainer saves one (adapter + tokenizer), and its probe logprobs."""
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    model = get_peft_model(base, config).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
        logits = model(input_ids=torch.tensor([PROBE])).logits[0, :-1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(PROBE[1:])[:, None])
    out = tmp_path_factory.mktemp("checkpoint")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(model_dir)).save_pretrained(out)
    return out, expected[:, 0].tolist()


def test_an_adapter_checkpoint_is_applied_to_its_base(
    model_dir: Path, adapter: tuple[Path, list[float]]
) -> None:
    adapter_dir, expected = adapter
    assert json.loads((adapter_dir / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ] == str(model_dir)
    tuned = load_inference_engine(str(adapter_dir), device="cpu")
    base = load_inference_engine(str(model_dir), device="cpu")
    assert tuned.logprobs_of(PROBE) == pytest.approx(expected, abs=1e-4)
    assert base.logprobs_of(PROBE) != pytest.approx(expected, abs=1e-2)


async def with_envhub(work: Callable[[str], T]) -> T:
    """Run blocking ``work(envhub_address)`` in a thread while a real EnvHub (letter) serves."""
    settings = EnvHubSettings(port=0, builtin_envs=["letter"])
    deps = EnvHubDeps.create(settings)
    hub, port = await create_envhub(settings, deps)
    try:
        return await asyncio.to_thread(work, f"127.0.0.1:{port}")
    finally:
        await hub.stop(0)
        await deps.close()


def test_infer_writes_one_line_per_episode_and_a_matching_summary(
    adapter: tuple[Path, list[float]], tmp_path: Path
) -> None:
    output = tmp_path / "out" / "letter.jsonl"
    seen: list[tuple[int, int]] = []

    def infer(address: str):  # noqa: ANN202 - the summary
        return run_inference(
            model=str(adapter[0]),
            env_name="letter",
            envhub_address=address,
            episodes=5,
            output=output,
            env_options={"num_letters": "4"},
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=3),
            seed=7,
            concurrency=2,
            device="cpu",
            progress=lambda done, total: seen.append((done, total)),
        )

    summary = asyncio.run(asyncio.wait_for(with_envhub(infer), 120))
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(lines) == 5 and seen == [(2, 5), (4, 5), (5, 5)]
    assert len({r["episode_id"] for r in lines}) == 5
    for record in lines:
        assert record["finish_reason"] == "ENV_DONE" and record["turns"] == 1
        assert record["info"]["target"] in "ABCD"
        roles = [m["role"] for m in record["messages"]]
        assert roles == ["system", "user", "assistant"]
        assert f"letter {record['info']['target']}" in record["messages"][1]["content"]
        # The env's verdict agrees with the text it was shown.
        answer = record["messages"][2]["content"].strip()
        assert record["reward"] == (1.0 if answer.startswith(record["info"]["target"]) else 0.0)
        assert record["transcript"].startswith("<|im_start|>system\n")
        assert record["messages"][1]["content"] in record["transcript"]
    assert summary.episodes == 5 and summary.output == output and summary.env_errors == 0
    assert summary.mean_reward == pytest.approx(sum(r["reward"] for r in lines) / 5)
    assert summary.accuracy == pytest.approx(sum(r["reward"] > 0 for r in lines) / 5)
    assert summary.mean_turns == 1.0

    # The same seed replays the same episodes.
    again = tmp_path / "again.jsonl"

    def replay(address: str):  # noqa: ANN202 - the summary
        return run_inference(
            model=str(adapter[0]),
            env_name="letter",
            envhub_address=address,
            episodes=5,
            output=again,
            env_options={"num_letters": "4"},
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=3),
            seed=7,
            concurrency=2,
            device="cpu",
        )

    asyncio.run(asyncio.wait_for(with_envhub(replay), 120))
    replayed = [json.loads(line) for line in again.read_text().splitlines()]
    assert [r["transcript"] for r in replayed] == [r["transcript"] for r in lines]


def test_infer_on_an_unknown_env_fails_naming_it(model_dir: Path, tmp_path: Path) -> None:
    def infer(address: str) -> None:
        run_inference(
            model=str(model_dir),
            env_name="chess",
            envhub_address=address,
            episodes=1,
            output=tmp_path / "x.jsonl",
        )

    with pytest.raises(NotFoundError, match="'chess'"):
        asyncio.run(asyncio.wait_for(with_envhub(infer), 60))
    assert not (tmp_path / "x.jsonl").exists()


def test_infer_local_from_the_cli_writes_rows_and_prints_the_summary(
    adapter: tuple[Path, list[float]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "local.jsonl"

    def cli(address: str) -> int:
        argv = [
            "infer", "--local", "--model", str(adapter[0]), "--env", "letter",
            "--envhub", address, "--episodes", "3", "--greedy", "--max-new-tokens", "2",
            "--output", str(output),
        ]  # fmt: skip
        with pytest.raises(SystemExit) as exited:
            main(argv)
        return int(exited.value.code or 0)

    assert asyncio.run(asyncio.wait_for(with_envhub(cli), 120)) == 0
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 3 and all(r["transcript"] for r in rows)
    # Greedy: the same prompt gets the same answer, whatever the episode's sampling seed.
    answers = {r["messages"][1]["content"]: r["messages"][2]["content"] for r in rows}
    assert all(answers[r["messages"][1]["content"]] == r["messages"][2]["content"] for r in rows)
    printed = capsys.readouterr().out.replace("\n", "")
    assert summarize(rows, output).describe("letter") in printed
