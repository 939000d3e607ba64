"""The cookbook conformance table (tools/cookbook_conformance.py) is produced from the
installed tinker-cookbook and the gateway's served set: every family of issue 33 has a row,
the ones a test runs say so, and what the gateway cannot serve is named."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
TOOL = Path(__file__).parents[2] / "tools" / "cookbook_conformance.py"


def _tool():
    spec = importlib.util.spec_from_file_location("cookbook_conformance", TOOL)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_family_has_a_row_with_a_reason() -> None:
    tool = _tool()
    rows = {r.family: r for r in tool.table()}
    assert set(rows) == set(tool.FAMILIES)
    assert all(r.why for r in rows.values())
    for family, how in tool.TESTED.items():
        assert rows[family].status == "runs (tested)"
        # the claim names a test file that exists and runs that recipe (it cannot drift)
        recipe, test_file = how.split(",")[0].split()[0], how.rsplit(": ", 1)[1]
        assert recipe in (TOOL.parent.parent / test_file).read_text(), (family, how)
    assert rows["vlm_classifier"].status == "not supported"
    assert "image chunks" in rows["vlm_classifier"].why
    table = tool.markdown(list(rows.values()))
    assert table.count("\n") == len(rows) + 1  # header, rule, one line per family
