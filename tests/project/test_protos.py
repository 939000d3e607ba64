"""The committed stubs are exactly what `make protos` generates, and the protocol follows
the style rules (versioned packages, enums starting at *_UNSPECIFIED, own request/response)."""

from __future__ import annotations

import filecmp
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_protos.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*"))
    assert generated, "the generator wrote nothing"
    stale = [
        str(p) for p in generated if not filecmp.cmp(tmp_path / p, ROOT / "sdk" / p, shallow=False)
    ]
    assert not stale, f"stubs differ from protos/ — run `make protos` and commit: {stale}"


def test_every_proto_declares_the_package_its_folder_names() -> None:
    for proto in (ROOT / "protos").rglob("*.proto"):
        rel = proto.relative_to(ROOT / "protos").parent
        expected = ".".join(rel.parts)
        text = proto.read_text()
        assert re.search(rf"^package {re.escape(expected)};", text, re.M), proto


def test_enums_start_unspecified_and_rpcs_have_own_messages() -> None:
    for proto in (ROOT / "protos").rglob("*.proto"):
        text = proto.read_text()
        for name, body in re.findall(r"enum (\w+) \{([^}]*)\}", text):
            first = re.search(r"(\w+)\s*=\s*0;", body)
            prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()
            assert first and first.group(1) == f"{prefix}_UNSPECIFIED", f"{proto.name}: {name}"
            values = re.findall(r"^\s*(\w+)\s*=", body, re.M)
            assert all(v.startswith(prefix + "_") for v in values), f"{name}: {values}"
        for method, req, resp in re.findall(
            r"rpc (\w+)\((?:stream )?(\w+)\) returns \((?:stream )?(\w+)\)", text
        ):
            assert req == f"{method}Request", f"{proto.name}: {method} takes {req}"
            assert resp == f"{method}Response", f"{proto.name}: {method} returns {resp}"
        for service in re.findall(r"^service (\w+)", text, re.M):
            assert service.endswith("Service"), service


@pytest.mark.parametrize("svc", ["common", "scheduler", "trainer", "rollout", "envhub"])
def test_stubs_import_under_their_proto_package(svc: str) -> None:
    module = importlib.import_module(
        f"opentinker.{svc}.v1.{'environment' if svc == 'envhub' else svc}_pb2"
    )
    assert module.DESCRIPTOR.package == f"opentinker.{svc}.v1"
