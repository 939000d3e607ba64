"""MkDocs hooks (`hooks:` in mkdocs.yml): the reference pages generated from the code.

- `reference/protocol.md` is rendered from the `.proto` comments by `tools/proto_docs.py`;
- `reference/cli.md` (hand-written overview) gets every command's help appended, from the CLI's
  own parser (`tools/cli_docs.py`);
- `reference/settings.md` gets every service's settings appended: variable, type, default and
  meaning, from the pydantic settings classes (`tools/settings_docs.py`);
- `notebooks/<name>.md` is each notebook of examples/notebooks/ with its saved outputs
  (`tools/notebook_docs.py`).

Both are made on every build, so they cannot fall behind the code; nothing generated is
committed.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType

from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

log = logging.getLogger("mkdocs.hooks.opentinker")


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py as a module (tools/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


proto_docs = load_tool("proto_docs")
cli_docs = load_tool("cli_docs")
settings_docs = load_tool("settings_docs")
notebook_docs = load_tool("notebook_docs")
APPENDED = {"reference/cli.md": cli_docs.render, "reference/settings.md": settings_docs.render}


def on_files(files: Files, config) -> Files:  # noqa: ANN001  (mkdocs' config type)
    """Add `reference/protocol.md`, rendered from protos/ now, and the notebooks' pages."""
    parsed = proto_docs.proto_files()
    missing = proto_docs.undocumented(parsed)
    log.info(
        "protocol reference: %d blocks, %d without a comment",
        sum(len(f.blocks) for f in parsed),
        len(missing),
    )
    content = proto_docs.render(parsed)
    files.append(File.generated(config, "reference/protocol.md", content=content))
    for uri, page in notebook_docs.pages().items():
        files.append(File.generated(config, uri, content=page))
    return files


def on_page_markdown(markdown: str, page: Page, **_: object) -> str:
    """Append every command's help to the CLI reference, every setting to the settings one."""
    render = APPENDED.get(page.file.src_uri)
    return markdown.rstrip() + "\n\n" + render() if render else markdown
