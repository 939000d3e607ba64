"""The docs site (mkdocs.yml, docs/) and the README's links into it.

The link and nav checks need nothing but the files; the strict build runs mkdocs itself (the
`docs` extra, which `.ci/run` and `make docs` install) and skips, saying so, where it is absent.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# Pages tools/docs_hooks.py adds at build time: the protocol, and each notebook.
GENERATED = {"reference/protocol.md"} | {
    f"notebooks/{p.stem}.md" for p in (ROOT / "examples" / "notebooks").glob("*.ipynb")
}
_LINK = re.compile(r"\]\(([^)\s]+)\)")


class _MkdocsLoader(yaml.SafeLoader):
    """mkdocs.yml names a python function with a !!python tag; this loader reads it as None."""


_MkdocsLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)


def _nav_pages(nav: list) -> set[str]:
    pages: set[str] = set()
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages |= _nav_pages(value) if isinstance(value, list) else {value}
    return pages


def _mkdocs_nav() -> set[str]:
    return _nav_pages(yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_MkdocsLoader)["nav"])


def _local_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.unit
def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    nav = _mkdocs_nav()
    assert pages - nav == set(), "pages missing from mkdocs.yml's nav"
    assert nav - pages - GENERATED == set(), "nav entries with no page in docs/"


@pytest.mark.unit
def test_every_link_in_the_docs_and_the_readme_names_a_file_that_exists() -> None:
    broken = []
    for page in [*DOCS.rglob("*.md"), ROOT / "README.md"]:
        for target in _local_links(page):
            path = (page.parent / target.split("#")[0]).resolve()
            rel = path.relative_to(DOCS).as_posix() if path.is_relative_to(DOCS) else None
            if not path.exists() and rel not in GENERATED:
                broken.append(f"{page.relative_to(ROOT)} → {target}")
    assert broken == []


@pytest.mark.unit
def test_the_readme_stays_short_and_points_into_the_docs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 15_000
    assert "make demo" in readme and "make test" in readme
    assert len([t for t in _local_links(ROOT / "README.md") if t.startswith("docs/")]) >= 5


@pytest.mark.unit
def test_the_protocol_reference_lists_every_service_and_rpc() -> None:
    spec = importlib.util.spec_from_file_location("proto_docs", ROOT / "tools" / "proto_docs.py")
    assert spec is not None and spec.loader is not None
    proto_docs = importlib.util.module_from_spec(spec)
    sys.modules["proto_docs"] = proto_docs  # its dataclasses look their module up there
    spec.loader.exec_module(proto_docs)
    page = proto_docs.render(proto_docs.proto_files())
    for proto in (ROOT / "protos").rglob("*.proto"):
        text = proto.read_text()
        for name in re.findall(r"^\s*(?:service|message|enum)\s+(\w+)", text, flags=re.M):
            assert f"`{name}`" in page or f".{name}`" in page, f"{proto.name}: {name}"
        for rpc in re.findall(r"^\s*rpc\s+(\w+)", text, flags=re.M):
            assert f"| `{rpc}` |" in page, f"{proto.name}: rpc {rpc}"
    # every service and top-level message says what it is for (the reference shows it)
    assert proto_docs.undocumented(proto_docs.proto_files()) == []


@pytest.mark.integration
def test_the_docs_site_builds_in_strict_mode(tmp_path: Path) -> None:
    why = "the docs extra is not installed (pip install -e '.[docs]', or make docs)"
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason=why)
    site = tmp_path / "site"
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    sdk_page = (site / "reference" / "sdk" / "index.html").read_text()
    assert 'id="opentinker.Client.fit"' in sdk_page  # mkdocstrings read the docstrings
    assert "SubmitJob" in (site / "reference" / "protocol" / "index.html").read_text()
    cli_page = (site / "reference" / "cli" / "index.html").read_text()
    assert "usage: opentinker models import" in cli_page  # every command's help, from argparse
    settings_page = (site / "reference" / "settings" / "index.html").read_text()
    assert "OPENTINKER_LEASE_TTL_S" in settings_page  # every setting, from pydantic
