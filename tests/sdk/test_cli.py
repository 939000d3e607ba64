"""The `opentinker` command: clear one-line errors, data conversion, and the parser's shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from opentinker.cli import build_parser

pytestmark = pytest.mark.unit


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "opentinker", *args], capture_output=True, text=True, timeout=60
    )


def test_an_invalid_spec_file_names_every_bad_field_without_a_traceback(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"rl": {"env_name": "letter", "steps": 0, "learning_rate": -1}}))
    out = run_cli("--scheduler", "127.0.0.1:1", "submit", str(spec))
    assert out.returncode == 2
    assert "rl.steps" in out.stdout and "rl.learning_rate" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr


def test_a_spec_that_is_not_json_names_the_file_and_the_format(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"  # a YAML spec: only JSON is read
    spec.write_text("name: x\nrl:\n  env_name: letter\n")
    out = run_cli("--scheduler", "127.0.0.1:1", "submit", str(spec))
    assert out.returncode == 2
    line = " ".join(out.stdout.split())  # rich wraps long lines
    assert "spec.yaml" in line and "not JSON" in line and "line 1 column 1" in line, line
    assert "Traceback" not in out.stdout + out.stderr


def test_a_missing_file_is_one_clear_line(tmp_path: Path) -> None:
    out = run_cli("data", str(tmp_path / "nope.jsonl"), str(tmp_path / "x.parquet"))
    assert out.returncode == 2
    assert "No such file" in out.stdout and "Traceback" not in out.stdout + out.stderr


def test_data_converts_jsonl_to_parquet(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow", reason="parquet needs pyarrow (server extra)")
    source = tmp_path / "rows.jsonl"
    source.write_text(
        "\n".join(json.dumps({"prompt": f"{i}+1?", "ground_truth": str(i + 1)}) for i in range(10))
    )
    out = run_cli("data", str(source), str(tmp_path / "rows.parquet"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "train: 10" in out.stdout
    from opentinker.data import Dataset

    rows = Dataset.load(tmp_path / "rows.parquet").rows("train")
    assert [r.ground_truth for r in rows] == [str(i + 1) for i in range(10)]


def test_an_unreachable_scheduler_is_reported_as_unavailable() -> None:
    out = run_cli("--scheduler", "127.0.0.1:1", "jobs")
    assert out.returncode == 2 and "UNAVAILABLE" in out.stdout


def test_every_service_can_be_served() -> None:
    parser = build_parser()
    for service in ("scheduler", "envhub", "worker", "trainer", "rollout", "tinker-gateway"):
        assert parser.parse_args(["serve", service]).service == service


def test_up_refuses_bad_and_taken_ports_naming_each_option(tmp_path: Path) -> None:
    """`up --gateway-port -1` was a raw pydantic error (while --dashboard-port -1 meant none),
    and a default port already taken on a shared machine ended in a traceback."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_cli(
            "up", "--run-root", str(tmp_path), "--scheduler-port", str(port),
            "--envhub-port", "70000", "--gateway-port", "-2",
        )  # fmt: skip
    said = " ".join(out.stdout.split())
    assert out.returncode == 2, said + out.stderr
    assert f"--scheduler-port {port}: already in use on this machine" in said
    assert "--envhub-port 70000: a TCP port is 0-65535" in said
    assert "--gateway-port -2: a TCP port is 0-65535 (-1 = off)" in said
    assert "Traceback" not in out.stdout + out.stderr
    assert not (tmp_path / "secrets").exists()  # refused before anything started


def test_infer_refuses_envhub_without_local() -> None:
    out = run_cli("--scheduler", "127.0.0.1:1", "infer", "--model", "m", "--env", "letter",
                  "--envhub", "127.0.0.1:2")  # fmt: skip
    said = " ".join(out.stdout.split())
    assert out.returncode == 2 and "--envhub is where --local plays" in said, said
