"""MkDocs hooks (`hooks:` in mkdocs.yml): add the generated reference pages to the site.

`reference/protocol.md` is rendered from the `.proto` comments by `tools/proto_docs.py` on
every build, so the page cannot fall behind the protocol; nothing generated is committed.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType

from mkdocs.structure.files import File, Files


def load_proto_docs() -> ModuleType:
    """tools/proto_docs.py as a module (tools/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(
        "proto_docs", Path(__file__).with_name("proto_docs.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["proto_docs"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


proto_docs = load_proto_docs()

log = logging.getLogger("mkdocs.hooks.opentinker")


def on_files(files: Files, config) -> Files:  # noqa: ANN001  (mkdocs' config type)
    """Add `reference/protocol.md`, rendered from protos/ now."""
    parsed = proto_docs.proto_files()
    missing = proto_docs.undocumented(parsed)
    log.info("protocol reference: %d blocks, %d without a comment",
             sum(len(f.blocks) for f in parsed), len(missing))
    files.append(File.generated(config, "reference/protocol.md", content=proto_docs.render(parsed)))
    return files
