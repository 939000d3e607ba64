"""GGUF files into the Hugging Face folder the pool loads (`opentinker models import`): the
same logits as the model written, the same tokenizer and chat template, quantized weights
dequantized, and clear refusals. The GGUFs are written here (tests/support/gguf_files.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_files import tiny_llama, write_llama_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

from opentinker.errors import ConfigError
from opentinker.services.modeling.gguf_import import import_gguf, inspect_gguf
from opentinker.services.modeling.tiny_model import build_tokenizer

pytestmark = pytest.mark.integration

IDS = torch.tensor([[1, 5, 9, 30, 100, 200, 300, 400]])


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(seed=3)


def test_a_float_gguf_imports_to_the_same_model_tokenizer_and_template(
    model: torch.nn.Module, tmp_path: Path
) -> None:
    info = import_gguf(write_llama_gguf(tmp_path / "m.gguf", model), tmp_path / "out")
    assert (info.architecture, info.context_length, info.chat_template) == ("llama", 256, True)
    assert info.tensor_types == {"F32": 21}
    assert info.parameters == sum(p.numel() for p in model.parameters())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert "quantization_config" not in json.loads((tmp_path / "out/config.json").read_text())
    with torch.no_grad():  # Q/K rows back in Hugging Face's order: exactly the same function
        assert torch.equal(model(IDS).logits, loaded(IDS).logits)
    tokenizer, original = AutoTokenizer.from_pretrained(tmp_path / "out"), build_tokenizer()
    text = "Answer with the letter Q. \\boxed{42} héllo"
    assert tokenizer(text)["input_ids"] == original(text)["input_ids"]
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        original.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    )
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")


def test_quantized_weights_are_dequantized_to_floats_close_to_the_original(
    model: torch.nn.Module, tmp_path: Path
) -> None:
    path = write_llama_gguf(tmp_path / "q.gguf", model, quantize="Q8_0")
    assert inspect_gguf(path).tensor_types == {"Q8_0": 16, "F32": 5}
    import_gguf(path, tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    with torch.no_grad():
        want, got = model(IDS).logits, loaded(IDS).logits
    assert not torch.equal(want, got)  # it was quantized
    assert (want - got).abs().max() < 0.05 * want.abs().max()  # Q8_0: ~1% error


def test_what_cannot_be_imported_is_refused_naming_why(
    model: torch.nn.Module, tmp_path: Path
) -> None:
    text = tmp_path / "model.gguf"
    text.write_text("not a model")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        inspect_gguf(text)
    with pytest.raises(FileNotFoundError):
        inspect_gguf(tmp_path / "missing.gguf")
    bloom = write_llama_gguf(tmp_path / "b.gguf", model, arch="bloom")
    with pytest.raises(ConfigError, match="architecture 'bloom' is not one the mesh runs"):
        inspect_gguf(bloom)
    odd = gguf.GGUFWriter(str(tmp_path / "i8.gguf"), "llama")
    odd.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.int8))
    odd.write_header_to_file()
    odd.write_kv_data_to_file()
    odd.write_tensors_to_file()
    odd.close()
    with pytest.raises(ConfigError, match=r"tensor types \['I8'\] cannot be dequantized"):
        inspect_gguf(tmp_path / "i8.gguf")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        import_gguf(write_llama_gguf(tmp_path / "m.gguf", model), taken)
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_the_cli_imports_and_says_what_it_imported(model: torch.nn.Module, tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "m.gguf", model, quantize="Q8_0")
    out = subprocess.run(
        [sys.executable, "-m", "opentinker", "models", "import", str(path), "--out",
         str(tmp_path / "hf")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    said = " ".join(out.stdout.split())
    assert "imported tiny-llama (llama, 0.1M parameters, context 256 tokens" in said
    assert "F32 x5, Q8_0 x16, chat template)" in said and '"base_model"' in said
    assert (tmp_path / "hf" / "model.safetensors").exists()
    again = subprocess.run(
        [sys.executable, "-m", "opentinker", "models", "import", str(path), "--out",
         str(tmp_path / "hf")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert again.returncode == 2 and "exists and is not empty" in " ".join(again.stdout.split())
    assert "Traceback" not in again.stdout + again.stderr


def test_the_token_that_ends_a_turn_becomes_the_eos(model: torch.nn.Module, tmp_path: Path) -> None:
    """A GGUF naming its end of text as eos while its template closes turns with another token
    (as Gemma 3's <eos> and <end_of_turn>): the rollout stops turns at the eos, and would
    generate past the turn's end."""
    path = write_llama_gguf(tmp_path / "m.gguf", model, eos="<|endoftext|>")
    import_gguf(path, tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.eos_token == "<|im_end|>"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ends = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    assert loaded.generation_config.eos_token_id == ends


def test_the_imported_folder_is_readable_by_every_uid_whatever_the_umask(
    model: torch.nn.Module, tmp_path: Path
) -> None:
    """Jobs may run as other uids than the importer (worker job_uids): a tight umask must not
    make the model 0600 (issue 35)."""
    path = write_llama_gguf(tmp_path / "m.gguf", model)
    old = os.umask(0o077)
    try:
        import_gguf(path, tmp_path / "out")
    finally:
        os.umask(old)
    modes = {
        p.name: p.stat().st_mode & 0o777 for p in [tmp_path / "out", *(tmp_path / "out").rglob("*")]
    }
    assert modes["out"] == 0o755
    assert {m for name, m in modes.items() if name != "out"} == {0o644}, modes


def test_the_demo_imports_a_gguf_replaced_in_place_anew(tmp_path: Path) -> None:
    """The real-model demo's cache (`opentinker demo --model smollm2 --gguf F`) is keyed by the
    file's path, size and modification time, as the worker's imports are: a GGUF replaced under
    the same name is imported again, not served from the old import."""
    from opentinker.services.launcher.smollm2 import imported_model

    source, cache = tmp_path / "m.gguf", tmp_path / "cache"
    write_llama_gguf(source, tiny_llama(seed=3))
    first = imported_model(source, cache, "m")
    assert imported_model(source, cache, "m") == first  # the same file: the same import
    write_llama_gguf(source, tiny_llama(seed=4))
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 1_000_000))
    second = imported_model(source, cache, "m")
    assert second != first
    new = AutoModelForCausalLM.from_pretrained(second)(IDS).logits
    old = AutoModelForCausalLM.from_pretrained(first)(IDS).logits
    assert not torch.allclose(new, old)  # the new weights, not the cached ones
