"""tinker-cookbook's ``sl_loop`` and ``rl_loop`` recipes, unchanged, against the gateway in
front of a real mesh, offline: the recipes' model name (Qwen/Qwen3-8B, so the cookbook picks
its qwen3 renderer) is mapped by the gateway to the tiny local model, whose tokenizer the test
registers with the cookbook's own ``register_tokenizer``; the Hugging Face datasets the
recipes name are read from local JSON files written here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest
import tinker
from tinker_cookbook.recipes import rl_loop, sl_loop
from tinker_cookbook.tokenizer_utils import register_tokenizer, unregister_tokenizer
from tinker_gateway_helpers import QWEN, gateway, mesh, monkeypatch_module
from transformers import AutoTokenizer

pytestmark = [pytest.mark.integration, pytest.mark.slow]
__all__ = ["gateway", "mesh", "monkeypatch_module"]  # fixtures used here


@pytest.fixture(scope="module")
def offline_cookbook(gateway, mesh, letter_model_dir: Path, tmp_path_factory, monkeypatch_module):
    """The key in TINKER_API_KEY, the tiny tokenizer under the recipes' model name, and
    ``datasets.load_dataset`` of the recipes' hub datasets answered from local files. The
    ServiceClients the recipes make are closed at the end, while the gateway still runs: the
    recipes leave theirs open, and its heartbeat thread logged connection errors for minutes
    once the gateway had stopped, into later tests and past pytest's end."""
    root = tmp_path_factory.mktemp("datasets")
    files = {
        "HuggingFaceH4/no_robots": _write(root / "no_robots.jsonl", _chats(16)),
        "openai/gsm8k": _write(root / "gsm8k.jsonl", _questions(8)),
    }
    real_load = datasets.load_dataset

    def load_local(name: str, *args, **kwargs):
        return real_load("json", data_files={"train": str(files[name])})

    monkeypatch_module.setenv("TINKER_API_KEY", f"tml-{mesh.api_key}")
    monkeypatch_module.setattr(datasets, "load_dataset", load_local)
    register_tokenizer(QWEN, lambda: AutoTokenizer.from_pretrained(letter_model_dir))
    made: list[tinker.ServiceClient] = []
    make = tinker.ServiceClient.__init__

    def recorded(self: tinker.ServiceClient, *args: Any, **kwargs: Any) -> None:
        make(self, *args, **kwargs)
        made.append(self)

    monkeypatch_module.setattr(tinker.ServiceClient, "__init__", recorded)
    yield
    unregister_tokenizer(QWEN)
    assert made, "the recipes made no ServiceClient: nothing to close"
    for client in made:
        client.close("success").result(timeout=30)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _chats(n: int) -> list[dict]:
    """no_robots rows: one short exchange repeated, so the SFT loss has something to learn."""
    messages = [
        {"role": "user", "content": "Answer with the letter B."},
        {"role": "assistant", "content": "B"},
    ]
    return [{"messages": messages, "prompt": "", "prompt_id": str(i)} for i in range(n)]


def _questions(n: int) -> list[dict]:
    return [{"question": "Which letter?", "answer": "It is A.\n#### A"} for _ in range(n)]


def _metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_sl_loop_runs_unchanged_and_its_loss_falls(gateway, offline_cookbook, tmp_path) -> None:
    config = sl_loop.Config(
        base_url=gateway,
        log_path=str(tmp_path / "sl"),
        model_name=QWEN,
        batch_size=4,
        learning_rate=5e-2,
        lora_rank=4,
        save_every=2,
        max_steps=4,
    )
    sl_loop.main(config)
    nll = [row["train_mean_nll"] for row in _metrics(tmp_path / "sl")]
    assert len(nll) == 4 and nll[-1] < 0.8 * nll[0], nll
    checkpoints = (tmp_path / "sl" / "checkpoints.jsonl").read_text()
    assert "tinker://" in checkpoints and '"final"' in checkpoints


def test_rl_loop_runs_unchanged_with_its_default_loss(gateway, offline_cookbook, tmp_path) -> None:
    """rl_loop with its default loss, stable_reinforce (sampling records named by provenance).

    The one thing here that is not the recipe's: its gsm8k grader wants a ``\\boxed{}`` answer,
    and the only models offline are random-init tiny ones that never write one, so every
    reward would be 0, every batch skipped (all advantages zero) and no step taken. Warm-starting
    the policy through the recipe's own resume path did not help: 40 supervised LoRA steps
    (through the gateway, on the recipe's prompt answered ``\\boxed{A..D}``) took the summed
    loss from 896 to 377 over 76 target tokens (~5 nats a token) and 0 of 8 temperature-1
    samples then held a ``\\boxed{}``; full-weight fine-tuning of the tiny model on the same
    data (plain torch, Adam 1e-2) reached 0.97 nats a token after 30 steps (~80 s on this
    machine) and still 0 of 8 samples were graded correct (``boxed{C{C}{{/}``...). A fixture
    that trains long enough to get mixed rewards would cost minutes per run, so the reward is
    swapped for the letter the question asks for (the tiny model is nudged to answer with
    letters)."""

    def reward(response: str, answer: str) -> float:
        return 1.0 if "A" in response else 0.0

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rl_loop, "get_reward", reward)
        config = rl_loop.Config(
            base_url=gateway,
            log_path=str(tmp_path / "rl"),
            model_name=QWEN,
            batch_size=2,
            group_size=4,
            learning_rate=5e-2,
            lora_rank=4,
            save_every=0,
            max_tokens=6,
            max_steps=3,
        )
        assert config.loss_fn == "stable_reinforce"  # the recipe's default, unchanged
        rl_loop.main(config)
    rows = _metrics(tmp_path / "rl")
    assert len(rows) == 3, rows
    assert all(0.0 <= row["reward/total"] <= 1.0 for row in rows)
    stepped = [row for row in rows if "optim/grad_norm:mean" in row or "grad_norm:mean" in row]
    assert stepped, rows  # at least one batch had mixed rewards and took a stable_reinforce step
