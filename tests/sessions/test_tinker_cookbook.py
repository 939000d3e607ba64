"""tinker-cookbook's ``sl_loop``, ``chat_sl``, ``rl_loop`` and ``math_rl`` recipes, unchanged,
against the gateway in front of a real mesh, offline: the recipes' model name (Qwen/Qwen3-8B,
so the cookbook picks its qwen3 renderer) is mapped by the gateway to the tiny local model,
whose tokenizer the test registers with the cookbook's own ``register_tokenizer``; the Hugging
Face datasets the recipes name are read from local JSON files written here."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from cookbook_offline import close_after_each, json_splits, metrics, offline_recipes, write_jsonl
from tinker_cookbook.recipes import rl_loop, sl_loop
from tinker_cookbook.recipes.chat_sl import train as chat_sl_train
from tinker_cookbook.recipes.math_rl import train as math_rl_train
from tinker_gateway_helpers import QWEN, gateway, mesh, monkeypatch_module

pytestmark = [pytest.mark.integration, pytest.mark.slow]
__all__ = ["gateway", "mesh", "monkeypatch_module"]  # fixtures used here


@pytest.fixture(scope="module")
def offline_cookbook(gateway, mesh, letter_model_dir: Path, tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("datasets")
    chats, held_out = (write_jsonl(root / f"{n}.jsonl", _chats(16)) for n in ("chats", "held"))
    gsm8k = write_jsonl(root / "gsm8k.jsonl", _questions(8))
    loaders = {
        "HuggingFaceH4/no_robots": lambda *a, **k: json_splits(train=chats, test=held_out),
        "openai/gsm8k": lambda *a, **k: json_splits(train=gsm8k),
    }
    with offline_recipes(mesh.api_key, letter_model_dir, monkeypatch_module, loaders) as close:
        yield close


_close_recipe_clients = close_after_each("offline_cookbook")


def _chats(n: int) -> list[dict]:
    """no_robots rows: one short exchange repeated, so the SFT loss has something to learn."""
    messages = [
        {"role": "user", "content": "Answer with the letter B."},
        {"role": "assistant", "content": "B"},
    ]
    return [{"messages": messages, "prompt": "", "prompt_id": str(i)} for i in range(n)]


def _questions(n: int) -> list[dict]:
    return [{"question": "Which letter?", "answer": "It is A.\n#### A"} for _ in range(n)]


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
    nll = [row["train_mean_nll"] for row in metrics(tmp_path / "sl")]
    assert len(nll) == 4 and nll[-1] < 0.8 * nll[0], nll
    checkpoints = (tmp_path / "sl" / "checkpoints.jsonl").read_text()
    assert "tinker://" in checkpoints and '"final"' in checkpoints


def test_chat_sl_runs_unchanged_and_its_loss_falls(gateway, offline_cookbook, tmp_path) -> None:
    """chat_sl's CLI on no_robots (local rows): supervised.train's pipelined loop, which
    submits the next forward_backward before the last optim_step has answered."""
    config = chat_sl_train.CLIConfig(
        base_url=gateway,
        log_path=str(tmp_path / "chat_sl"),
        model_name=QWEN,
        dataset="no_robots",
        batch_size=4,
        learning_rate=5e-2,
        lora_rank=4,
        max_length=64,
        max_steps=3,
    )
    chat_sl_train.cli_main(config)
    nll = [
        row["train_mean_nll"] for row in metrics(tmp_path / "chat_sl") if "train_mean_nll" in row
    ]
    assert len(nll) == 3 and nll[-1] < 0.9 * nll[0], nll
    checkpoints = (tmp_path / "chat_sl" / "checkpoints.jsonl").read_text()
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
    rows = metrics(tmp_path / "rl")
    assert len(rows) == 3, rows
    assert all(0.0 <= row["reward/total"] <= 1.0 for row in rows)
    stepped = [row for row in rows if "optim/grad_norm:mean" in row or "grad_norm:mean" in row]
    assert stepped, rows  # at least one batch had mixed rewards and took a stable_reinforce step


def test_math_rl_arithmetic_runs_unchanged(gateway, offline_cookbook, tmp_path) -> None:
    """math_rl's CLI on its arithmetic env (no hub data): rl.train's loop, sampling from
    ``save_weights_and_get_sampling_client`` each iteration, graded by the recipe's own
    reward (answer correct, minus 0.1 without the stop sequence). The random-init tiny model
    never answers right (reward -0.1 throughout, so its steps carry no signal); what can fail
    here is the loop itself and that the sampler and the trainer agree on the sampled tokens'
    logprobs (``kl_sample_train`` ~ 0: the sampler is the weights it was saved from)."""
    config = math_rl_train.CLIConfig(
        base_url=gateway,
        log_path=str(tmp_path / "math_rl"),
        model_name=QWEN,
        env="arithmetic",
        lora_rank=4,
        group_size=4,
        groups_per_batch=2,
        learning_rate=5e-2,
        eval_every=0,
        save_every=0,
        max_steps=2,
    )
    asyncio.run(math_rl_train.cli_main(config))
    rows = [row for row in metrics(tmp_path / "math_rl") if "optim/entropy" in row]
    assert len(rows) == 2, rows  # both iterations sampled, graded and trained
    for row in rows:
        assert -0.1 <= row["env/all/reward/total"] <= 1.0, row
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-3, row
