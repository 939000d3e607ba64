"""What the vLLM GPU tests share: the model they run on, chat prompts, and the largest
difference between two logprob lists."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from opentinker.services.modeling.tiny_model import QWEN2_5_0_5B_SHAPE, build_tiny_model


def gpu_test_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen2.5-0.5B-shaped model (random init): gpu_check.sh builds it once and names it
    in OPENTINKER_GPU_TEST_MODEL; otherwise built here."""
    built = os.environ.get("OPENTINKER_GPU_TEST_MODEL")
    if built and (Path(built) / "config.json").is_file():
        return Path(built)
    return build_tiny_model(tmp_path_factory.mktemp("qwen2.5-0.5b-shape"), **QWEN2_5_0_5B_SHAPE)


def prompts(engine, n: int = 8) -> list[list[int]]:
    """``n`` chat prompts of different lengths, tokenized by ``engine``'s tokenizer."""
    return [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Answer with the letter {chr(65 + i)}. " * (1 + i % 3)}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(n)
    ]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
