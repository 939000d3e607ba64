"""Render the protocol reference (markdown) from the comments in `protos/**/*.proto`.

The docs site builds its "Protocol" reference page from this at build time (`tools/docs_hooks.py`
adds the page; nothing generated is committed). Run by hand to see the markdown:

    .venv/bin/python tools/proto_docs.py > /tmp/protocol.md

The parser reads the subset of proto3 our files use, line by line: a run of `//` lines right
above a `service`, `rpc`, `message`, `enum`, field or enum value documents it, as does a `//`
comment at the end of its line. Nested messages and enums are listed under their parent's
name (`Job.Attempt`). `undocumented()` names every service and top-level message without a
comment (the build logs how many; tests/project/test_docs.py fails on any).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"

_BLOCK = re.compile(r"^(service|message|enum)\s+(\w+)\s*\{")
_RPC = re.compile(
    r"^rpc\s+(\w+)\s*\(\s*(stream\s+)?([\w.]+)\s*\)"
    r"\s*returns\s*\(\s*(stream\s+)?([\w.]+)\s*\)"
)
_FIELD = re.compile(r"^(repeated\s+|optional\s+)?(map<[^>]+>|[\w.]+)\s+(\w+)\s*=\s*(\d+)")
_GROUP = re.compile(r"^(oneof|extend)\s+[\w.]+\s*\{")
_VALUE = re.compile(r"^(\w+)\s*=\s*(-?\d+)")


@dataclass
class Item:
    """One line inside a block: an rpc, a field or an enum value, with its comment."""

    name: str
    detail: str  # rpc: "Request → Response"; field: its type and number; value: its number
    doc: str


@dataclass
class Block:
    """A service, message or enum: its kind, full name, comment and items."""

    kind: str
    name: str
    doc: str
    items: list[Item] = field(default_factory=list)


@dataclass
class ProtoFile:
    """One .proto file: its path, package, header comment and blocks in order."""

    path: str
    package: str
    doc: str
    blocks: list[Block] = field(default_factory=list)


def _split_comment(line: str) -> tuple[str, str]:
    """The code of a line and its trailing `//` comment (quotes in our files hold no `//`)."""
    code, _, comment = line.partition("//")
    return code.strip(), comment.strip()


def parse(path: Path) -> ProtoFile:
    """Parse one .proto file into its blocks; raises ValueError naming an unbalanced brace."""
    pf = ProtoFile(path=str(path.relative_to(ROOT)), package="", doc="")
    stack: list[Block] = []
    pending: list[str] = []
    header_done = False
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("//"):
            pending.append(line[2:].strip())
            continue
        code, trailing = _split_comment(line)
        if not code:
            if not header_done and pending:
                pf.doc, header_done = " ".join(pending), True
            pending = []
            continue
        if code.startswith(("syntax", "package", "import", "option")):
            if not header_done and pending:
                pf.doc = " ".join(pending)
            header_done = True
            if code.startswith("package"):
                pf.package = code.split()[1].rstrip(";")
            pending = []
            continue
        header_done = True
        doc = " ".join([*pending, trailing]).strip()
        pending = []
        if m := _BLOCK.match(code):
            name = ".".join([*(b.name for b in stack[-1:] if b.kind == "message"), m.group(2)])
            block = Block(kind=m.group(1), name=name, doc=doc)
            pf.blocks.append(block)
            stack.append(block)
            if code.endswith("}"):
                stack.pop()
            continue
        if _GROUP.match(code):  # a oneof's fields belong to its message; extensions to none
            parent = stack[-1] if stack and code.startswith("oneof") else Block("extend", "", "")
            stack.append(Block("oneof" if code.startswith("oneof") else "extend", parent.name, ""))
            stack[-1].items = parent.items
            continue
        if code.startswith("}"):
            if not stack:
                raise ValueError(f"{pf.path}: unbalanced '}}'")
            stack.pop()
            continue
        if not stack:
            continue
        top = stack[-1]
        if top.kind == "service" and (m := _RPC.match(code)):
            req = ("stream " if m.group(2) else "") + m.group(3)
            resp = ("stream " if m.group(4) else "") + m.group(5)
            top.items.append(Item(m.group(1), f"`{req}` → `{resp}`", doc))
        elif top.kind in ("message", "oneof") and (m := _FIELD.match(code)):
            label = (m.group(1) or "").strip()
            kind = f"{label} {m.group(2)}".strip()
            top.items.append(Item(m.group(3), f"`{kind}` = {m.group(4)}", doc))
        elif top.kind == "enum" and (m := _VALUE.match(code)):
            top.items.append(Item(m.group(1), m.group(2), doc))
    if stack:
        raise ValueError(f"{pf.path}: '{stack[-1].name}' is never closed")
    return pf


def proto_files() -> list[ProtoFile]:
    """Every .proto under protos/, parsed, in path order."""
    return [parse(p) for p in sorted(PROTOS.rglob("*.proto"))]


def undocumented(files: list[ProtoFile]) -> list[str]:
    """`path: name` of every service and top-level message that has no comment."""
    return [
        f"{pf.path}: {b.kind} {b.name}"
        for pf in files
        for b in pf.blocks
        if b.kind in ("service", "message") and "." not in b.name and not b.doc
    ]


def _text(text: str) -> str:
    """Comment text as markdown: brackets escaped (`[a-z]` is no link), one line."""
    return text.replace("[", "\\[").replace("]", "\\]")


def _cell(text: str) -> str:
    return _text(text).replace("|", "\\|") or " "


def render_block(b: Block) -> list[str]:
    """Markdown for one service, message or enum: heading, comment, then a table of items."""
    out = [f"### {b.kind} `{b.name}`", ""]
    if b.doc:
        out += [_text(b.doc), ""]
    if b.items:
        head = {"service": "rpc | request → response", "message": "field | type = number"}
        out += [f"| {head.get(b.kind, 'value | number')} | |", "| --- | --- | --- |"]
        out += [f"| `{i.name}` | {i.detail} | {_cell(i.doc)} |" for i in b.items]
        out.append("")
    return out


def render(files: list[ProtoFile]) -> str:
    """The whole protocol reference page."""
    out = [
        "# Protocol reference",
        "",
        "Generated at build time from the comments in `protos/` by `tools/proto_docs.py`; the",
        "`.proto` files are the source of truth.",
        "",
    ]
    for pf in files:
        out += [f"## `{pf.package}` — `{pf.path}`", ""]
        if pf.doc:
            out += [_text(pf.doc), ""]
        for b in pf.blocks:
            out += render_block(b)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render(proto_files()))
